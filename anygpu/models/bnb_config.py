"""``BnbQuantization``: a config.json's bitsandbytes ``quantization_config``, read and checked.

    BnbQuantization.from_hf(cfg["quantization_config"], where="folder/config.json")
    # BnbQuantization(bits=4, quant_type="nf4", double_quant=True, compute_dtype=torch.bfloat16, ...)

transformers writes this object next to a model saved with ``BitsAndBytesConfig`` (``load_in_4bit`` /
``load_in_8bit``, ``bnb_4bit_*``, ``llm_int8_*``); ``anygpu.nn.save_quantized`` writes it the same way.  Only what
decides how the stored weights are read is kept: the packed tensors and their quant states carry the rest
(blocksize, shapes, the tables), and are read as stored.  Other quantization
methods (GPTQ, AWQ, FP8...) are refused here, naming the method, before a weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_STORAGES = {**_DTYPES, "uint8": torch.uint8}


@dataclass(frozen=True)
class BnbQuantization:
    bits: int                          # 4 (Linear4bit) or 8 (Linear8bitLt, LLM.int8())
    quant_type: str = "nf4"            # 4-bit: "nf4" | "fp4"
    double_quant: bool = False         # 4-bit: absmax quantized again (the nested_* tensors)
    compute_dtype: torch.dtype = torch.float32  # what bitsandbytes computes in; the engine uses its own --dtype
    quant_storage: torch.dtype = torch.uint8    # 4-bit: the packed tensor's dtype
    threshold: float = 6.0             # 8-bit: LLM.int8()'s outlier threshold
    skip_modules: tuple[str, ...] = ()  # modules kept in full precision (lm_head is always, in transformers)

    @classmethod
    def from_hf(cls, qc, where: str = "config.json") -> BnbQuantization:
        key = "quantization_config"
        if not isinstance(qc, dict):
            raise ValueError(f"{where}: {key}: expected an object, got {qc!r:.100}")
        method = qc.get("quant_method", "bitsandbytes")
        if method != "bitsandbytes":
            raise ValueError(f"{where}: {key}.quant_method: {method!r} checkpoints are not supported; only "
                             "bitsandbytes ones (load_in_4bit / load_in_8bit) are")
        four, eight = bool(qc.get("load_in_4bit", False)), bool(qc.get("load_in_8bit", False))
        if four == eight:
            raise ValueError(f"{where}: {key}: expected exactly one of load_in_4bit and load_in_8bit to be true, got "
                             f"load_in_4bit={qc.get('load_in_4bit')!r}, load_in_8bit={qc.get('load_in_8bit')!r}")
        quant_type = qc.get("bnb_4bit_quant_type", "fp4")  # bitsandbytes' and transformers' default
        if four and quant_type not in ("nf4", "fp4"):
            raise ValueError(f"{where}: {key}.bnb_4bit_quant_type: expected 'nf4' or 'fp4', got {quant_type!r}")
        compute = _dtype(qc.get("bnb_4bit_compute_dtype"), _DTYPES, torch.float32,
                         f"{where}: {key}.bnb_4bit_compute_dtype")
        storage = _dtype(qc.get("bnb_4bit_quant_storage"), _STORAGES, torch.uint8,
                         f"{where}: {key}.bnb_4bit_quant_storage")
        threshold = qc.get("llm_int8_threshold", 6.0)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1e6:
            raise ValueError(f"{where}: {key}.llm_int8_threshold: expected a number >= 0, got {threshold!r}")
        skip = qc.get("llm_int8_skip_modules") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
            raise ValueError(f"{where}: {key}.llm_int8_skip_modules: expected a list of module names or null, "
                             f"got {skip!r:.100}")
        return cls(bits=4 if four else 8, quant_type=quant_type if four else "nf4",
                   double_quant=bool(qc.get("bnb_4bit_use_double_quant", False)) if four else False,
                   compute_dtype=compute, quant_storage=storage, threshold=float(threshold),
                   skip_modules=tuple(skip))


def _dtype(value, table: dict, default: torch.dtype, where: str) -> torch.dtype:
    if value is None:
        return default
    if isinstance(value, str) and value.removeprefix("torch.") in table:
        return table[value.removeprefix("torch.")]
    raise ValueError(f"{where}: expected one of {', '.join(table)}, got {value!r}")


def infer_from_tensors(names) -> BnbQuantization | None:
    """The quantization a folder's tensor names show when config.json has no ``quantization_config`` (a model
    quantized by ``quantize_model`` and saved with ``save_pretrained``, which writes none): 4-bit when a
    ``...weight.quant_state.bitsandbytes__<type>`` blob is there, 8-bit when an ``...SCB`` is; None otherwise.
    What the loader needs beyond that, each layer's quant state holds."""
    blob = next((n for n in names if ".weight.quant_state.bitsandbytes__" in n), None)
    if blob is not None:
        quant_type = blob.rsplit("__", 1)[1]
        return BnbQuantization(bits=4, quant_type=quant_type if quant_type in ("nf4", "fp4") else "nf4",
                               double_quant=any(n.endswith(".weight.nested_absmax") for n in names))
    if any(n.endswith(".SCB") for n in names):
        return BnbQuantization(bits=8)
    return None
