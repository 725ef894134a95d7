"""Write a transformers model as llama.cpp's converter (``convert_hf_to_gguf.py``) would, for the tests.

    path = write_hf_as_gguf(tmp_path / "m.gguf", hf_model)      # F32 tensors (or matrix_type="Q8_0"...), a
                                                                # 258-token byte-level vocabulary

Tensor names come from the ``gguf`` package's own map (``gguf.get_tensor_name_map``), not from anygpu's loader,
and the converter's conversions are applied here: Llama's q/k rows permuted, Gemma's RMSNorm weights stored as
(1 + w), Phi-3's LongRoPE factors as ``rope_factors_long`` / ``rope_factors_short`` tensors.  The metadata keys
are those the converter writes for each architecture (including what it leaves out: Gemma's
query_pre_attn_scalar, sliding-window period and local rope base are llama.cpp's per-architecture rules).
The model's vocabulary must be the 258 tokens ``add_byte_vocab`` writes (256 byte-level ones, <s>, </s>).
"""

from __future__ import annotations

import math

import numpy as np
import torch

BYTE_VOCAB = 258  # the 256 byte-level tokens, <s> (256), </s> (257)
_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3",
         "phi3": "phi3"}


def add_byte_vocab(w) -> None:
    """A byte-level BPE vocabulary without merges (``tokenizer.ggml.model = "gpt2"``), bos 256, eos 257."""
    from tokenizers import pre_tokenizers

    w.add_tokenizer_model("gpt2")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<s>", "</s>"])
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)


def write_gguf(path, arch: str, meta: dict, tensors: dict[str, np.ndarray], matrix_type: str = "F32") -> str:
    """A GGUF of ``arch`` with ``meta`` ({key without the "<arch>." prefix: int, float, str or list of bools}),
    the byte vocabulary, and ``tensors`` (GGUF name -> fp32 or fp16 array, written as F32 / F16; the matrices
    quantized by ``gguf.quants`` to ``matrix_type`` when it is another type, e.g. "Q8_0")."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    types = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32,
             str: gguf.GGUFValueType.STRING}
    for key, value in meta.items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_key_value(f"{arch}.{key}", value, types[type(value)])
    add_byte_vocab(w)
    for name, array in tensors.items():
        if matrix_type in ("F32", "F16") or array.ndim != 2:
            w.add_tensor(name, np.ascontiguousarray(array))
        else:
            qtype = gguf.GGMLQuantizationType[matrix_type]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows to interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_metadata(arch: str, c) -> dict:
    """The ``<arch>.*`` keys convert_hf_to_gguf.py writes for an HF config ``c`` of ``arch``."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    meta = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "feed_forward_length": c.intermediate_size, "block_count": c.num_hidden_layers,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps), "vocab_size": c.vocab_size}
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if arch == "gemma3":
        rope = rope.get("full_attention", rope)
    meta["rope.freq_base"] = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    if arch != "phi3":
        meta["attention.key_length"] = meta["attention.value_length"] = head_dim
    if arch == "llama":
        meta["rope.dimension_count"] = head_dim
    if arch == "gemma2":
        meta["attn_logit_softcapping"] = float(c.attn_logit_softcapping)
        meta["final_logit_softcapping"] = float(c.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        meta["attention.sliding_window"] = c.sliding_window
    if arch == "gemma3" and rope.get("rope_type", "default") == "linear":
        meta["rope.scaling.type"] = "linear"
        meta["rope.scaling.factor"] = float(rope["factor"])
    if arch == "phi3":
        partial = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
        meta["rope.dimension_count"] = int(partial * c.hidden_size) // c.num_attention_heads
        meta["attention.sliding_window"] = c.sliding_window or 0  # 0: Phi-4, no window
        original = rope.get("original_max_position_embeddings", getattr(c, "original_max_position_embeddings", None))
        if original is not None:
            meta["rope.scaling.original_context_length"] = original
        if rope.get("rope_type") == "longrope":
            scale = c.max_position_embeddings / original
            meta["rope.scaling.attn_factor"] = (math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0
                                                else 1.0)
    return meta


def gguf_tensors(arch: str, hf) -> dict[str, np.ndarray]:
    """GGUF name -> fp32 array of every weight of ``hf``, as the converter writes them for ``arch``."""
    import gguf

    c = hf.config
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    out = {}
    for name, w in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"the gguf package has no {arch} name for {name}"
        w = w.detach().float().clone()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            w = _permute_qk(w, c.num_attention_heads if base.endswith("q_proj") else c.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1
        out[f"{gguf_name}.{suffix}"] = w.numpy()
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    return out


def write_hf_as_gguf(path, hf, matrix_type: str = "F32") -> str:
    """``hf`` (a transformers CausalLM of llama, qwen2, qwen3, gemma2, gemma3_text or phi3) as a GGUF at ``path``,
    its matrices in ``matrix_type`` (norms and rope factors stay F32)."""
    arch = _ARCH[hf.config.model_type]
    assert hf.config.vocab_size == BYTE_VOCAB, "the file's vocabulary is the 258 byte-level tokens"
    return write_gguf(path, arch, gguf_metadata(arch, hf.config), gguf_tensors(arch, hf), matrix_type)
