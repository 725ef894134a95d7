"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) on anygpu's ops.

One forward runs a flat batch: the new tokens of every scheduled sequence packed end to end ([T]), as the
engine's scheduler mixes prefills, prefill chunks and decodes in one step.  Per layer:

    rms_norm / fused_add_rms_norm -> qkv_proj (one fused Linear) -> rotary_embedding (in place, NeoX pairs)
    -> reshape_and_cache (the new K/V into the paged cache) -> attention -> o_proj
    -> fused_add_rms_norm -> gate_up_proj (one fused Linear) -> silu_and_mul -> down_proj

Attention picks its op from the batch (``AttentionBatch.mode``): ``flash_attn_varlen`` over the new K/V when no
sequence has cached context (a plain prefill: the fastest kernel), ``paged_decode`` when every sequence brings
one token (the decode step, CUDA-graph safe: no host read), and ``paged_prefill`` otherwise (chunked prefill,
prefix-cache hits, a step mixing decodes and prefills).

Linears are plain ``nn.Linear``, so ``anygpu.nn.quantize_model`` swaps them for NF4/FP4/int8 layers and
``anygpu.tunable.route`` sends them through the tuner, with no model code of their own.  Fusing q/k/v and
gate/up into one Linear each means one GEMM (and one quantized matmul) instead of three or two.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..ops import (
    flash_attn_varlen,
    fused_add_rms_norm,
    paged_decode,
    paged_prefill,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from ..ops.rotary_embedding import rotary_cos_sin_cache
from .config import ModelConfig

MODES = ("prefill", "decode", "mixed")


@dataclass
class AttentionBatch:
    """What attention needs to know about one step's flat batch (built by the engine's model runner)."""

    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token
    mode: str  # one of MODES
    cu_seqlens_q: torch.Tensor | None = None  # int32 [B + 1] (prefill, mixed)
    max_seqlen_q: int = 0
    seqlens_k: torch.Tensor | None = None  # int32 [B]: context length after this step (decode, mixed)
    max_seqlen_k: int = 0
    block_tables: torch.Tensor | None = None  # int32 [B, max_blocks] (decode, mixed)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5
        # HF's sliding window W lets a token see itself and the W - 1 before it.
        self.window_left = cfg.sliding_window - 1 if cfg.sliding_window else -1
        self.rotary: torch.Tensor | None = None  # the model's shared fp32 [max_position, head_dim] cos|sin table
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        rotary_embedding(batch.positions, q, k, self.rotary, True)
        k_cache, v_cache = self.kv_cache
        reshape_and_cache(k, v, k_cache, v_cache, batch.slot_mapping)
        if batch.mode == "prefill":
            out = flash_attn_varlen(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_q, batch.max_seqlen_q,
                                    batch.max_seqlen_q, self.scale, True, self.window_left)
        elif batch.mode == "decode":
            out = paged_decode(q, k_cache, v_cache, batch.block_tables, batch.seqlens_k, batch.max_seqlen_k,
                               self.scale, self.window_left)
        else:
            out = paged_prefill(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seqlens_k,
                                batch.max_seqlen_q, batch.max_seqlen_k, self.scale, self.window_left)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, batch: AttentionBatch):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """``model(input_ids [T], batch) -> hidden [T, hidden]``; ``compute_logits(hidden [B, hidden])`` -> fp32."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = cfg
        device = torch.device(device)
        with torch.device("meta"):  # no memory until to_empty; load_weights (or random_weights_) fills it
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to_empty(device=device).to(dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Made after to_empty (which would leave it uninitialised) and kept fp32 whatever the model's dtype.
        self.rotary = rotary_cos_sin_cache(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling,
                                           device=device)
        for layer in self.layers:
            layer.self_attn.rotary = self.rotary

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def set_kv_caches(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(caches) != len(self.layers):
            raise ValueError(f"caches: expected one (key, value) pair per layer ({len(self.layers)}), got {len(caches)}")
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.kv_cache = cache

    # -- weights ---------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (``Checkpoint.weights()``): q/k/v land in their rows of qkv_proj, gate/up in
        theirs of gate_up_proj.  Every parameter must be written exactly once; an unknown name, a wrong shape or a
        missing tensor is a ValueError naming it (a silently half-loaded model would generate garbage)."""
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens.weight
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
                 "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}
        expected = set()
        for pname in params:
            parts = pname.split(".")
            starts = {s for f, s, _ in fused.values() if len(parts) >= 2 and parts[-2] == f}
            expected |= {(pname, s) for s in (starts or {0})}
        written: set[tuple[str, int]] = set()
        for name, tensor in weights:
            target, rows = name.removeprefix("model."), None
            if cfg.tie_word_embeddings and target == "lm_head.weight":
                continue  # a checkpoint may store the tied copy too
            parts = target.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, start, size = fused[parts[-2]]
                target, rows = ".".join([*parts[:-2], fused_name, parts[-1]]), (start, size)
            param = params.get(target)
            if param is None:
                raise ValueError(f"weights: unexpected tensor {name!r} for a {cfg.architecture} model")
            dest = param.data if rows is None else param.data.narrow(0, *rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            written.add((target, rows[0] if rows else 0))
        missing = sorted(expected - written)
        if missing:
            raise ValueError(f"weights: {len(missing)} tensor(s) missing from the checkpoint, e.g. "
                             f"{[f'{n} rows {s}:' if s else n for n, s in missing[:3]]}")
