"""``save_quantized(model, folder)``: a model quantized by ``quantize_model`` as a Hugging Face folder that
transformers + bitsandbytes and anygpu both load.

    model = transformers.AutoModelForCausalLM.from_pretrained("org/name", dtype=torch.bfloat16)
    quantize_model(model, "nf4")
    save_quantized(model, "name-nf4", tokenizer=tokenizer)
    # transformers: AutoModelForCausalLM.from_pretrained("name-nf4")   anygpu: anygpu generate --model name-nf4

``model.save_pretrained`` alone writes the bitsandbytes tensors but no ``quantization_config``, so no loader knows
they are packed.  This writes config.json with the ``quantization_config`` transformers' ``BitsAndBytesConfig``
would (read from the layers: 4-bit type, double quantization, compute dtype, storage; or 8-bit and its
threshold; the Linears left in full precision as ``llm_int8_skip_modules``), model.safetensors with the
bitsandbytes keys (``weight.absmax``, ``weight.quant_state.bitsandbytes__nf4``, ``SCB``...), and the generation
config and tokenizer when there are.  A tied weight is stored once, under its first name, as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .linear4bit import Linear4bit
from .linear8bit import Linear8bitLt


def save_quantized(model: nn.Module, folder: str | Path, *, tokenizer=None) -> Path:
    """Write ``model`` (a transformers model whose Linears ``quantize_model`` replaced) to ``folder``; returns it.
    ``tokenizer``: anything with ``save_pretrained(folder)`` (a transformers tokenizer), saved alongside."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_dict", None)):
        raise ValueError(f"model: expected a transformers model (its config has to_dict()), got "
                         f"{type(model).__name__} with config {type(config).__name__}")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder}: exists and is not a folder")
    quantization = quantization_config(model)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict()
    cfg["quantization_config"] = quantization
    if not cfg.get("architectures"):  # what save_pretrained records, and loaders pick the model class by
        cfg["architectures"] = [type(model).__name__]
    if not cfg.get("dtype") and not cfg.get("torch_dtype"):
        floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
        cfg["dtype"] = str(floats[0] if floats else torch.float32).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    _save_tensors(model, folder / "model.safetensors")
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def quantization_config(model: nn.Module) -> dict:
    """The ``quantization_config`` of config.json for ``model``'s quantized layers (BitsAndBytesConfig's keys)."""
    four = {n: m for n, m in model.named_modules() if isinstance(m, Linear4bit)}
    eight = {n: m for n, m in model.named_modules() if isinstance(m, Linear8bitLt)}
    if not four and not eight:
        raise ValueError("model: no Linear4bit or Linear8bitLt layer: quantize it first (anygpu.nn.quantize_model)")
    if four and eight:
        raise ValueError(f"model: mixes 4-bit ({next(iter(four))}) and 8-bit ({next(iter(eight))}) layers; a "
                         "bitsandbytes checkpoint has one kind")
    skipped = [n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not isinstance(m, (Linear4bit, Linear8bitLt))]
    config = {"_load_in_4bit": bool(four), "_load_in_8bit": bool(eight), "bnb_4bit_compute_dtype": "float32",
              "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False,
              "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
              "llm_int8_skip_modules": skipped or None, "llm_int8_threshold": 6.0, "load_in_4bit": bool(four),
              "load_in_8bit": bool(eight), "quant_method": "bitsandbytes"}
    if eight:
        config["llm_int8_threshold"] = _one(eight, lambda m: float(m.threshold), "threshold")
        return config
    states = {n: getattr(m.weight, "quant_state", None) for n, m in four.items()}
    unquantized = [n for n, s in states.items() if s is None]
    if unquantized:
        raise ValueError(f"model: {unquantized[0]} is a Linear4bit not quantized yet (move it to a device first)")
    config["bnb_4bit_quant_type"] = _one(four, lambda m: m.weight.quant_state.quant_type, "quant_type")
    config["bnb_4bit_use_double_quant"] = _one(four, lambda m: m.weight.quant_state.nested, "double quantization")
    config["bnb_4bit_quant_storage"] = _name(_one(four, lambda m: m.weight.dtype, "quant_storage"))
    config["bnb_4bit_compute_dtype"] = _name(_one(four, lambda m: m.compute_dtype or torch.float32, "compute_dtype"))
    return config


def _one(layers: dict, get, what: str):
    values = {}
    for name, layer in layers.items():
        values.setdefault(get(layer), name)
    if len(values) > 1:
        shown = ", ".join(f"{name}: {value}" for value, name in values.items())
        raise ValueError(f"model: the quantized layers differ in {what} ({shown}); a bitsandbytes config.json "
                         "states one for all")
    return next(iter(values))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _save_tensors(model: nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    canonical = {name for name, _ in model.named_parameters()}  # a tied parameter: its first name only
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if name in every and name not in canonical:
            continue
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen and tensor.numel():  # safetensors refuses shared memory (a shared table, a view): a copy
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    save_file(tensors, str(path), metadata={"format": "pt"})
