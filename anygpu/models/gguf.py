"""``GGUFCheckpoint``: a llama.cpp GGUF file as config, tokenizer and fp32 weights under Hugging Face names.

    ckpt = GGUFCheckpoint("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config, ckpt.tokenizer
    for name, w in ckpt.weights():      # ("model.layers.0.self_attn.q_proj.weight", fp32 [576, 576]), ...

Tensors are dequantized in torch (F32, F16, BF16, Q8_0, Q4_0, Q4_1), bit-identical to ``gguf.quants.dequantize``
(the fp32 math is the same: convert the f16 scale, multiply, then add the min, no FMA).  llama.cpp's converter
reorders the rows of q_proj/k_proj of arch "llama" per head, from Hugging Face's rotate-half layout to
interleaved pairs; that is undone here, so one NeoX-style rotary path serves GGUF and safetensors alike.
Any other tensor type (K-quants, IQ-quants...) is refused when the file is opened, naming the tensor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

from .config import GGUF_KEYS, ModelConfig
from .shape_check import check_tensor_shapes
from .tokenizer import Tokenizer

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one this loader does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 tensor of ``shape`` from the raw little-endian bytes (uint8) of a GGUF tensor of type ``type_name``."""
    raw = raw.reshape(-1)
    if type_name == "F32":
        out = raw.view(torch.float32).clone()  # clone: never hand out a view of the file mapping
    elif type_name in ("F16", "BF16"):
        out = raw.view(torch.float16 if type_name == "F16" else torch.bfloat16).float()  # both exact in fp32
    elif type_name == "Q8_0":  # blocks of 32: d f16, qs int8[32]; x = qs * d
        blocks = raw.view(-1, 34)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        out = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    elif type_name in ("Q4_0", "Q4_1"):
        # Q4_0 blocks: d f16, qs u8[16]; x = (q - 8) * d.  Q4_1: d f16, m f16, qs u8[16]; x = q * d + m.
        # Byte j holds element j (low nibble) and element j + 16 (high nibble).
        header = 2 if type_name == "Q4_0" else 4
        blocks = raw.view(-1, header + 16)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        qs = blocks[:, header:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=1)
        if type_name == "Q4_0":
            out = (q.to(torch.int8) - 8).float() * d
        else:
            out = q.float() * d + blocks[:, 2:4].contiguous().view(torch.float16).float()
    else:
        raise ValueError(f"GGUF tensor type {type_name} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    return out.reshape(shape)


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of q/k (weight [out, in] or bias [out]): inside each head, rows
    (0, 2, 4, ..., 1, 3, 5, ...) of the GGUF back to HF's (first halves, then second halves)."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = self.path.name
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        from gguf import GGUFReader

        try:
            # 'c' (copy-on-write): the mapping is writable for torch.from_numpy, and nothing reaches the file.
            self.reader = GGUFReader(self.path, "c")
        except Exception as e:  # bad magic, unknown version, truncated tables... all surface as a bad file
            raise ValueError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        self.metadata = {k: f.contents() for k, f in self.reader.fields.items() if not k.startswith("GGUF.")}
        tensors = self.reader.tensors
        for t in tensors:
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path}: tensor {t.name} has type {t.tensor_type.name}, which is not supported; "
                                 f"supported: {', '.join(SUPPORTED_TYPES)} (re-quantize the model to one of them)")
            if hf_name(t.name) is None:
                # e.g. rope_freqs.weight (llama.cpp's form of Llama 3.1 rope scaling): dropping it would be wrong.
                raise ValueError(f"{self.path}: tensor {t.name} is not supported by this loader")
        config = ModelConfig.from_gguf(self.metadata, tensor_names=[t.name for t in tensors], where=str(self.path))
        # GGUF lists ne0 (the row length) first; HF shapes are the other way round.
        shapes = {hf_name(t.name): tuple(int(n) for n in reversed(t.shape.tolist())) for t in tensors}
        keys = {k: f"{config.architecture}.{v}" for k, v in GGUF_KEYS.items()}
        check_tensor_shapes(config, shapes, where=str(self.path), config_where="its metadata", keys=keys)
        self.config = config
        self.tokenizer = Tokenizer.from_gguf(self.metadata)

    def weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 CPU tensor) for every tensor of the file, in file order."""
        from tqdm.auto import tqdm

        cfg = self.config
        for t in tqdm(self.reader.tensors, desc=f"Loading {self.name}", unit="tensor", disable=not progress):
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ne0 (the row length) first
            raw = torch.from_numpy(t.data.reshape(-1)).view(torch.uint8)
            w = dequantize(raw, t.tensor_type.name, shape)
            name = hf_name(t.name)
            if cfg.architecture == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                w = unpermute_qk(w, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
            yield name, w
