"""``GGUFCheckpoint``: a llama.cpp GGUF file as config, tokenizer and weights under Hugging Face names.

    ckpt = GGUFCheckpoint("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config, ckpt.tokenizer
    for name, w in ckpt.weights():      # ("model.layers.0.self_attn.q_proj.weight", fp32 [576, 576]), ...

Architectures (``general.architecture``), each read as llama.cpp reads it and yielding the tensors of the same
model's HF checkpoint, so one decoder (``llama.py``) runs GGUF and safetensors alike:

| architecture | family         | beyond Llama's tensors and keys                                                     |
|--------------|----------------|-------------------------------------------------------------------------------------|
| llama        | llama, mistral | q/k rows permuted by the converter (undone here); ``rope_freqs.weight`` (3.1+)      |
| qwen2        | qwen2          | q/k/v biases                                                                        |
| qwen3        | qwen3          | ``attn_q_norm`` / ``attn_k_norm`` (RMSNorm of each q and k head)                    |
| gemma2       | gemma2         | ``post_attention_norm``, ``ffn_norm`` (pre-MLP), ``post_ffw_norm``; every norm      |
|              |                | stored as 1 + w (given back as HF's w); ``attn_logit_softcapping``,                 |
|              |                | ``final_logit_softcapping``; ``attention.sliding_window`` on every other layer      |
| gemma3       | gemma3 (text)  | gemma2's norms plus q/k norm; no soft-caps; the window on five layers in six,       |
|              |                | whose rope base is 10000 (``rope.freq_base_swa`` if present)                        |
| phi3         | phi3 (Phi-3/4) | ``attn_qkv`` and ``ffn_up`` (gate rows, then up) fused, as HF stores them;          |
|              |                | ``rope.dimension_count`` (partial rotary); LongRoPE: ``rope_factors_long`` /        |
|              |                | ``rope_factors_short``, ``rope.scaling.original_context_length``, ``.attn_factor``; |
|              |                | ``attention.sliding_window`` on every layer (0: none)                               |

What llama.cpp does not store but hard-codes per architecture is applied the same way: Gemma's attention scale
(head_dim ** -0.5, or (hidden / heads) ** -0.5 for the 27B models, told apart by their layer count), the sliding
period (2 for Gemma 2, 6 for Gemma 3; an ``attention.sliding_window_pattern`` key overrides it).  Any other
architecture is refused when the file is opened, naming it; a tensor its architecture does not have is refused
naming the tensor.

Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS, dequantized in torch
(``anygpu.quant.gguf_blocks``) bit-identical to ``gguf.quants.dequantize``; any other type is refused when the file
is opened, naming the tensor.  ``weights(dtype=...)`` dequantizes one tensor at a time, in chunks, straight into
that dtype, and gives each tensor's file pages back to the OS once it is decoded, so loading holds the model plus
one tensor, not the file's fp32 image.  llama.cpp's converter reorders the rows of q_proj/k_proj of arch "llama"
per head, from Hugging Face's rotate-half layout to interleaved pairs; that is undone here, so one NeoX-style
rotary path serves GGUF and safetensors alike (the other architectures use NeoX rotary in llama.cpp too and are
stored unpermuted).
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from typing import Iterator

import torch

from .._progress import disabled
from ..quant.gguf_blocks import SUPPORTED_TYPES, dequantize_blocks
from .config import GGUF_KEYS, ModelConfig
from .gguf_file import TensorInfo, read_gguf
from .shape_check import check_tensor_shapes
from .tokenizer import Tokenizer

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's sandwich norms: llama.cpp's ffn_norm is the MLP's input norm, which HF calls pre_feedforward_layernorm.
_SANDWICH = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
# What each architecture (general.architecture) names differently from, or adds to, Llama's layer tensors.
_ARCH_LAYER_NAMES = {
    "llama": {}, "qwen2": {},
    "qwen3": _QK_NORM,
    "gemma2": _SANDWICH,
    "gemma3": {**_SANDWICH, **_QK_NORM},
    # q/k/v fused as attn_qkv, gate/up fused as ffn_up (gate rows first): HF's own fused tensors, unsplit
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1+ rope scaling as llama.cpp stores it: one divisor per rotated frequency (F32), read into the config.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE factors (long contexts, short contexts), read into the config.
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Tensors that are config values, not weights, and the architectures that have them.
_CONFIG_TENSORS = {ROPE_FREQS: ("llama", "qwen2", "qwen3"), ROPE_FACTORS[0]: ("phi3",), ROPE_FACTORS[1]: ("phi3",)}
# llama.cpp stores Gemma's RMSNorm weights as (1 + w), the factor they scale by; HF stores w.
_NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of a model of ``architecture`` (GGUF's general.architecture), or None
    for one this loader does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None:
        return None
    module = _ARCH_LAYER_NAMES.get(architecture, {}).get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
    return None if module is None else f"model.layers.{m.group(1)}.{module}.{m.group(3)}"


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new ``dtype`` tensor of ``shape`` from the raw little-endian bytes (uint8) of a GGUF tensor of type
    ``type_name`` (never a view of ``raw``: the caller may unmap it)."""
    out = torch.empty(shape, dtype=dtype)
    dequantize_blocks(raw.reshape(-1), type_name, out=out.view(-1))
    return out


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of q/k (weight [out, in] or bias [out]): inside each head, rows
    (0, 2, 4, ..., 1, 3, 5, ...) of the GGUF back to HF's (first halves, then second halves)."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permuted_heads(cfg, name: str) -> int | None:
    """The heads whose rows llama.cpp's converter permuted in tensor ``name`` (a Llama-architecture q or k, for
    ``unpermute_qk``), or None for every other tensor."""
    if cfg.architecture != "llama" or (".attn_q." not in name and ".attn_k." not in name):
        return None
    return cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads


class GGUFCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = self.path.name
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        parsed = read_gguf(self.path)
        self.metadata = parsed.metadata
        self.tensors: list[TensorInfo] = parsed.tensors
        arch = self.metadata.get("general.architecture")
        if arch not in _ARCH_LAYER_NAMES:  # before any tensor: the architecture is what is missing
            ModelConfig.from_gguf(self.metadata, where=str(self.path))  # raises, naming it and the supported ones
        for t in self.tensors:
            if t.type_name not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path}: tensor {t.name} has type {_type_label(t)}, which is not supported; "
                                 f"supported: {', '.join(SUPPORTED_TYPES)} (re-quantize the model to one of them)")
            if hf_name(t.name, arch) is None and arch not in _CONFIG_TENSORS.get(t.name, ()):
                raise ValueError(f"{self.path}: tensor {t.name} is not supported by this loader for architecture "
                                 f"{arch!r}")
        by_name = {t.name: t for t in self.tensors}
        freqs = by_name.get(ROPE_FREQS)
        factors = [by_name.get(n) for n in ROPE_FACTORS]
        if (factors[0] is None) != (factors[1] is None):
            raise ValueError(f"{self.path}: tensor {ROPE_FACTORS[factors[1] is None]} is missing; LongRoPE needs "
                             f"both {' and '.join(ROPE_FACTORS)}")
        config = ModelConfig.from_gguf(
            self.metadata, tensor_names=list(by_name), where=str(self.path),
            rope_freqs=None if freqs is None else self._small(freqs),
            rope_factors=None if factors[0] is None else (self._small(factors[0]), self._small(factors[1])))
        shapes = {hf_name(t.name, arch): t.shape for t in self.tensors if t.name not in _CONFIG_TENSORS}
        keys = {k: f"{config.architecture}.{v}" for k, v in GGUF_KEYS.items()}
        check_tensor_shapes(config, shapes, where=str(self.path), config_where="its metadata", keys=keys)
        self.config = config
        self.tokenizer = Tokenizer.from_gguf(self.metadata)

    def _small(self, t: TensorInfo) -> list[float]:
        """A small tensor's values (rope_freqs: head_dim / 2 floats), read once when the file is opened."""
        if t.nbytes > 1 << 16:  # head_dim <= 1024: at most 512 factors; refuse before reading a lying tensor
            raise ValueError(f"{self.path}: tensor {t.name} has shape {t.shape}; expected head_dim / 2 values")
        with open(self.path, "rb") as f:
            f.seek(t.offset)
            raw = torch.frombuffer(bytearray(f.read(t.nbytes)), dtype=torch.uint8)
        return dequantize(raw, t.type_name, t.shape).reshape(-1).tolist()

    def weights(self, progress: bool = True, dtype: torch.dtype = torch.float32,
                skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, ``dtype`` CPU tensor) for every tensor of the file but those named (GGUF names) in ``skip``,
        in file order, one at a time."""
        from tqdm.auto import tqdm

        cfg = self.config
        shift_norms = _NORM_SHIFT.get(cfg.architecture, 0.0)
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
            # ACCESS_COPY: writable for torch.frombuffer (no read-only warning); nothing ever reaches the file.
            for t in tqdm(self.tensors, desc=f"Loading {self.name}", unit="tensor", disable=disabled(progress)):
                if t.name in skip or t.name in _CONFIG_TENSORS:  # rope factors are in the config, not weights
                    continue
                shift = shift_norms and t.name.endswith("norm.weight")
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset)
                w = dequantize(raw, t.type_name, t.shape, torch.float32 if shift else dtype)
                del raw  # the mapping cannot close while a view exports it
                _release(mm, t.offset, t.nbytes)
                heads = permuted_heads(cfg, t.name)
                if heads is not None:
                    w = unpermute_qk(w, heads)
                if shift:  # back to HF's w, in fp32 (a small vector): the model adds the offset back once
                    w -= shift_norms
                yield hf_name(t.name, cfg.architecture), w


def _release(mm: mmap.mmap, offset: int, nbytes: int) -> None:
    """Drop the decoded tensor's pages from this process (they count in its resident set until unmapped)."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset - offset % mmap.PAGESIZE
    end = offset + nbytes - (offset + nbytes) % mmap.PAGESIZE  # whole pages only: a neighbour may share the rest
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def _type_label(t: TensorInfo) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(t.type_id).name
    except (ImportError, ValueError):
        return t.type_name
