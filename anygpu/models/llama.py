"""The decoder of every supported family (Llama 2/3, Mistral, Qwen2, SmolLM2, Qwen3, Gemma 2/3, Phi-3) on anygpu's ops.

One forward runs a flat batch: the new tokens of every scheduled sequence packed end to end ([T]), as the
engine's scheduler mixes prefills, prefill chunks and decodes in one step.  Per layer:

    rms_norm / fused_add_rms_norm -> qkv_proj (one fused Linear) -> rotary_and_cache (rotary in place on q and k,
    NeoX pairs, and the new K/V into the paged cache: one launch) -> attention -> o_proj
    -> fused_add_rms_norm -> gate_up_proj (one fused Linear) -> silu_and_mul -> down_proj

Other families are this model with switches (``families.py``: ``config.family``) and config values: q/k norm
per head, Gemma's sandwich norms, (1 + weight) norms (folded into the weight at load), scaled embeddings, GELU,
soft-capped attention and logits, per-layer sliding windows and rope tables, partial rotary, fused checkpoints.

Attention picks its op from the batch (``AttentionBatch.mode``): ``flash_attn_varlen`` over the new K/V when no
sequence has cached context (a plain prefill: the fastest kernel), ``paged_decode`` when every sequence brings
one token (the decode step, CUDA-graph safe: no host read), and ``paged_prefill`` otherwise (chunked prefill,
prefix-cache hits, a step mixing decodes and prefills).

Linears are plain ``nn.Linear``, so ``anygpu.nn.quantize_model`` swaps them for NF4/FP4/int8 layers and
``anygpu.tunable.route`` sends them through the tuner, with no model code of their own.  Fusing q/k/v and
gate/up into one Linear each means one GEMM (and one quantized matmul) instead of three or two.

Tensor parallelism (``tp=TensorParallel(rank, world_size)``, rules in ``parallel.py``): each rank's Linears hold
its shard only (still plain ``nn.Linear``, so quantizing a sharded model quantizes the shards), o_proj and
down_proj outputs are all-reduced, and ``compute_logits`` all-gathers the vocab-parallel head so every rank
returns the full logits.  ``load_weights`` cuts each rank's shard out of the full checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..ops import (
    flash_attn_varlen,
    fused_add_rms_norm,
    gelu_and_mul,
    paged_decode,
    paged_prefill,
    rms_norm,
    rotary_and_cache,
    silu_and_mul,
)
from .config import ModelConfig
from .memory_check import check_model_fits
from .parallel import LlamaShard, TensorParallel
from .projection import norm_project, project
from .rope import rotary_table

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
    # decode: paged_decode's split count (None: the kernel plans it).  The runner sets the count of the decode
    # graph for the batch's size on eager steps too, so a step sums alike eager or replayed.
    num_splits: int | None = None


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
    def __init__(self, cfg: ModelConfig, shard: LlamaShard, tp: TensorParallel, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.tp = tp
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Row-parallel and bias-free (were there a bias, only one rank could add it: the all-reduce sums them all).
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.attn_scale or self.head_dim ** -0.5
        self.softcap = cfg.attn_softcap or 0.0
        # HF's sliding window W lets a token see itself and the W - 1 before it.
        self.sliding = bool(cfg.sliding_window) and (cfg.sliding_layers is None or cfg.sliding_layers[layer])
        self.window_left = cfg.sliding_window - 1 if self.sliding else -1
        self.qk_norm = cfg.family.qk_norm
        if self.qk_norm:  # one RMSNorm over head_dim, shared by every head (replicated under tp)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary: torch.Tensor | None = None  # a shared fp32 [max_position, rotary_dim] cos|sin table
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, qkv: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Attention from the layer's qkv projection (``qkv_proj``, run by the decoder layer) to o_proj's output."""
        tokens = qkv.shape[0]
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # new tensors, so rotary's in-place write no longer touches qkv
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = self.kv_cache
        # One launch for rotary_embedding then reshape_and_cache: q and k are rotated in place (prefill's
        # flash_attn_varlen reads this k), and the rotated k and v land in the cache.
        rotary_and_cache(batch.positions, q, k, v, self.rotary, True, k_cache, v_cache, batch.slot_mapping)
        if batch.mode == "prefill":
            out = flash_attn_varlen(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_q, batch.max_seqlen_q,
                                    batch.max_seqlen_q, self.scale, True, self.window_left, self.softcap)
        elif batch.mode == "decode":
            out = paged_decode(q, k_cache, v_cache, batch.block_tables, batch.seqlens_k, batch.max_seqlen_k,
                               self.scale, self.window_left, self.softcap, batch.num_splits)
        else:
            out = paged_prefill(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seqlens_k,
                                batch.max_seqlen_q, batch.max_seqlen_k, self.scale, self.window_left, self.softcap)
        return self.tp.all_reduce(project(self.o_proj, out.reshape(tokens, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: LlamaShard, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * shard.intermediate, bias=False)
        self.down_proj = nn.Linear(shard.intermediate, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """From the layer's gate/up projection (``gate_up_proj``, run by the decoder layer) to down_proj's output."""
        if self.act == "silu":
            h = silu_and_mul(gate_up)
        else:  # Gemma's gelu_pytorch_tanh, or the exact (erf) GELU
            h = gelu_and_mul(gate_up, "tanh" if self.act == "gelu_tanh" else "none")
        return self.tp.all_reduce(project(self.down_proj, h))


class DecoderLayer(nn.Module):
    """``(x, residual) -> (x, residual)``: the residual stream is added in the next norm (fused_add_rms_norm).
    Llama: post_attention_layernorm is the MLP's input norm.  Sandwich norms (Gemma): post_attention_layernorm
    normalizes the attention output before its residual add, pre_feedforward_layernorm is the MLP's input
    norm and post_feedforward_layernorm normalizes the MLP output."""

    def __init__(self, cfg: ModelConfig, shard: LlamaShard, tp: TensorParallel, layer: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg, shard, tp, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.sandwich = cfg.family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg, shard, tp)

    def forward(self, x, residual, batch: AttentionBatch):
        attn, mlp = self.self_attn, self.mlp
        if residual is None:
            qkv, residual = project(attn.qkv_proj, self.input_layernorm(x)), x
        else:  # the norms before qkv_proj and gate_up_proj: fused into an int8 projection's quantize launch
            qkv, residual = norm_project(self.input_layernorm, attn.qkv_proj, x, residual)
        x = attn(qkv, batch)
        if not self.sandwich:
            gate_up, residual = norm_project(self.post_attention_layernorm, mlp.gate_up_proj, x, residual)
            return mlp(gate_up), residual
        gate_up, residual = norm_project(self.pre_feedforward_layernorm, mlp.gate_up_proj,
                                         self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(mlp(gate_up)), residual


class LlamaForCausalLM(nn.Module):
    """``model(input_ids [T], batch) -> hidden [T, hidden]``; ``compute_logits(hidden [B, hidden])`` -> fp32.
    ``tp``: this rank's place in a tensor-parallel group (None: the whole model in this process)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp: TensorParallel | None = None, max_position: int | None = None):
        """``max_position``: the longest context this model will run (the engine's max_model_len), which sizes
        the rotary table; None: the config's max_position.  It never exceeds the config's."""
        super().__init__()
        if max_position is not None and (not isinstance(max_position, int) or isinstance(max_position, bool)
                                         or max_position < 1):
            raise ValueError(f"max_position: expected a positive int or None, got {max_position!r}")
        max_position = min(max_position or cfg.max_position, cfg.max_position)
        self.config = cfg
        self.tp = tp = tp if tp is not None else TensorParallel()
        self.shard = shard = LlamaShard.of(cfg, tp)
        device = torch.device(device)
        with torch.device("meta"):  # no memory until _materialize; load_weights fills it
            # Replicated: lookups only.  Given its (meta) weight, the embedding skips its normal_ init: on meta
            # that op runs PyTorch's Python reference, which imports torch._dynamo and sympy (about 900 modules)
            # into every process that builds a model, for values load_weights overwrites anyway.
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                             _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
            self.layers = nn.ModuleList(DecoderLayer(cfg, shard, tp, i) for i in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, shard.vocab_rows, bias=False)
        # The dtype is set while on meta, so _materialize allocates each weight once, in it (not fp32, then a copy).
        self.to(dtype)
        # Gemma scales embeddings by sqrt(hidden) rounded to the model's dtype, as transformers does (bf16: 55.5
        # for sqrt(3072) = 55.43): the checkpoint was trained with the rounded factor.
        self.embed_scale = (float(torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype))
                            if cfg.family.scaled_embeddings else None)
        self.max_position = max_position
        # Sized from the config on the meta device: refuse here, naming the field, what would not fit.
        check_model_fits(cfg, sum(p.numel() * p.element_size() for p in self.parameters()), max_position, device)
        self.allocate(device)

    def allocate(self, device: torch.device | str, lazy: Collection[str] = (),
                 staging: torch.device | str | None = None) -> None:
        """Allocate the weights on ``device`` (uninitialised: ``load_weights`` fills them) and build the rotary
        table there.  The weights of the Linears named in ``lazy`` stay on the meta device until ``load_weights``
        writes their first rows, and are then allocated on ``staging`` (default: ``device``): a model built on
        meta can be allocated whole but for the layers that ``build_model`` quantizes as they load, so their
        full-precision weights never all exist (and, staged on the host, never exist on the GPU at all)."""
        cfg = self.config
        self._device = device = torch.device(device)
        self._staging = device if staging is None else torch.device(staging)
        _materialize(self, device, {id(self.get_submodule(name).weight) for name in lazy})
        if cfg.tie_word_embeddings and self.tp.world_size == 1:
            self.lm_head.weight = self.embed_tokens.weight
        # (Tied under tp > 1: lm_head is this rank's rows of the embedding, a copy that load_weights fills.)
        if not self.lm_head.weight.is_meta:
            self._zero_head_padding()
        # Made after _materialize (which would leave it uninitialised) and kept fp32 whatever the model's dtype.  None
        # on meta (a model built there is allocated again for its device): its arange would run torch._refs there.
        self.rotary = None
        if device.type != "meta":
            self.build_rotary(self.max_position, device)

    def _zero_head_padding(self) -> None:
        """Zero the head's padding rows (tp: the last rank's vocab chunk): their logits are cut off anyway."""
        shard = self.shard
        if shard.vocab_real < shard.vocab_rows:
            self.lm_head.weight.data[shard.vocab_real:].zero_()

    def _allocate_lazy(self, target: str) -> nn.Parameter:
        """Parameter ``target``, left on the meta device by ``allocate(lazy=...)``, allocated on the staging
        device (``allocate``'s) at its first write."""
        module_name, _, attr = target.rpartition(".")
        module = self.get_submodule(module_name)
        meta = getattr(module, attr)
        setattr(module, attr, nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=self._staging),
                                           requires_grad=meta.requires_grad))
        if target == "lm_head.weight":
            self._zero_head_padding()
        return getattr(module, attr)

    def build_rotary(self, max_position: int, device: torch.device) -> None:
        """The rotary table the layers share, on ``device`` (``allocate`` builds it); with ``rope_local_theta``
        (Gemma 3), the sliding layers share a second one."""
        cfg = self.config
        self.rotary = rotary_table(cfg, max_position, device)
        local = rotary_table(cfg, max_position, device, local=True) if cfg.rope_local_theta is not None else None
        for layer in self.layers:
            attn = layer.self_attn
            attn.rotary = local if local is not None and attn.sliding else self.rotary

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = project(self.lm_head, hidden)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather_last_dim(logits)[:, : self.config.vocab_size]  # drop the padding rows
        logits = logits.float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap  # Gemma 2: logits stay in (-cap, cap)

    def set_kv_caches(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(caches) != len(self.layers):
            raise ValueError(f"caches: expected one (key, value) pair per layer ({len(self.layers)}), got {len(caches)}")
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.kv_cache = cache

    # -- weights ---------------------------------------------------------------------------------------
    def _placements(self) -> dict[str, _Placement]:
        """Where each HF projection goes: q/k/v into their rows of qkv_proj, gate/up into gate_up_proj, and which
        part of the full tensor is this rank's (rows of column-parallel ones, columns of row-parallel ones)."""
        cfg, s, d = self.config, self.shard, self.config.head_dim
        q, kv, inter = s.num_heads * d, s.num_kv_heads * d, s.intermediate
        heads = _Cut(0, cfg.num_heads * d, s.head_start * d, q)
        kv_heads = _Cut(0, cfg.num_kv_heads * d, s.kv_head_start * d, kv)
        inter_rows = _Cut(0, cfg.intermediate_size, s.intermediate_start, inter)
        return {"q_proj": _Placement("qkv_proj", 0, heads), "k_proj": _Placement("qkv_proj", q, kv_heads),
                "v_proj": _Placement("qkv_proj", q + kv, kv_heads),
                "gate_proj": _Placement("gate_up_proj", 0, inter_rows),
                "up_proj": _Placement("gate_up_proj", inter, inter_rows),
                "o_proj": _Placement("o_proj", 0, _Cut(1, cfg.num_heads * d, s.head_start * d, q)),
                "down_proj": _Placement("down_proj", 0, _Cut(1, cfg.intermediate_size, s.intermediate_start, inter)),
                "lm_head": _Placement("lm_head", 0, _Cut(0, cfg.vocab_size, s.vocab_start, s.vocab_real))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     replace: Mapping[str, Callable[[nn.Module], nn.Module]] | None = None) -> None:
        """Copy HF-named full tensors in (``Checkpoint.weights()``): q/k/v land in their rows of qkv_proj, gate/up
        in theirs of gate_up_proj, each cut to this rank's shard under tensor parallelism.  Every parameter must
        be written exactly once; an unknown name, a wrong shape or a missing tensor is a ValueError naming it (a
        silently half-loaded model would generate garbage).  A weight left on the meta device (``allocate(lazy=
        ...)``) is allocated at its first write.  ``replace``: {module name: make}: that module is swapped for
        ``make(module)`` as soon as all its parameters' rows are written, dropping its full-precision weight then
        (``build_model(quantize=...)`` quantizes each projection so); a tensor of it that comes after is an
        error."""
        cfg = self.config
        loading = _Loading(self, replace or {})
        placements = loading.placements
        tied_copy = cfg.tie_word_embeddings and "lm_head.weight" in loading.params  # tp > 1: see below
        if cfg.family.fused_checkpoint:
            weights = split_fused(weights, cfg)
        for name, tensor in weights:
            target = name.removeprefix("model.")
            if cfg.tie_word_embeddings and target == "lm_head.weight":
                continue  # a checkpoint may store the tied copy too
            parts = target.split(".")
            placement = placements.get(parts[-2]) if len(parts) >= 2 else None
            if placement is not None:
                target = ".".join([*parts[:-2], placement.module, parts[-1]])
            loading.write(name, target, tensor, placement)
            if tied_copy and target == "embed_tokens.weight":
                # tp > 1: the tied head is a separate parameter holding this rank's vocab rows
                loading.write(name, "lm_head.weight", tensor, placements["lm_head"])
        loading.check_complete()

    def _copy_in(self, params, name: str, target: str, tensor: torch.Tensor, placement: _Placement | None) -> None:
        param = params.get(target)
        if param is None:
            raise ValueError(f"weights: unexpected tensor {name!r} for a {self.config.architecture} model")
        dest, cut = param.data, placement.cut if placement else None
        if cut is not None:
            if cut.dim == 0:
                dest = dest.narrow(0, placement.row, cut.size)
            full = list(dest.shape)
            if len(full) > cut.dim:
                full[cut.dim] = cut.full  # the checkpoint holds the whole tensor, whatever this rank keeps
        else:
            full = list(dest.shape)
        if list(tensor.shape) != full:
            raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(full)}")
        offset = self.config.family.norm_offset
        if offset and target.endswith("norm.weight"):  # Gemma's norms scale by (1 + weight): fold the 1 in once
            tensor = tensor.float() + offset
        dest.copy_(tensor if cut is None else tensor.narrow(cut.dim, cut.start, cut.size))


class _Loading:
    """One ``load_weights`` call's bookkeeping: the (parameter, first row) pairs expected and written (q/k/v and
    gate/up fill rows of one parameter), and the modules to replace once all of theirs are written."""

    def __init__(self, model: LlamaForCausalLM, replace: Mapping[str, Callable[[nn.Module], nn.Module]]):
        self.model, self.replace = model, dict(replace)
        self.params = dict(model.named_parameters())  # a tied lm_head (tp == 1) appears once, as embed_tokens.weight
        self.placements = model._placements()
        fused_starts: dict[str, set[int]] = {}
        for p in self.placements.values():
            fused_starts.setdefault(p.module, set()).add(p.row)
        self.expected = set()
        for pname in self.params:
            parts = pname.split(".")
            module = parts[-2] if len(parts) >= 2 else ""
            self.expected |= {(pname, s) for s in fused_starts.get(module, {0})}
        self.written: set[tuple[str, int]] = set()
        by_module: dict[str, set[tuple[str, int]]] = {}
        for key in self.expected:
            by_module.setdefault(key[0].rpartition(".")[0], set()).add(key)
        self.pending = {m: by_module.get(m, set()) for m in self.replace}
        nothing = [m for m, keys in self.pending.items() if not keys]
        if nothing:  # it would never be replaced
            raise ValueError(f"replace: {nothing[:3]} are not modules with parameters to load")
        self.replaced: set[str] = set()

    def write(self, name: str, target: str, tensor: torch.Tensor, placement: _Placement | None) -> None:
        """Checkpoint tensor ``name`` into parameter ``target`` (at ``placement``); replaces its module if that
        completes one of ``replace``'s."""
        owner = target.rpartition(".")[0]
        if owner in self.replaced:
            raise ValueError(f"weights: {name!r} comes after {owner} was loaded whole and replaced (a tensor "
                             "given twice?)")
        if target in self.params and self.params[target].is_meta:
            self.params[target] = self.model._allocate_lazy(target)
        self.model._copy_in(self.params, name, target, tensor, placement)
        key = (target, placement.row if placement else 0)
        self.written.add(key)
        pending = self.pending.get(owner)
        if pending is not None:
            pending.discard(key)
            if not pending:
                self._replace(owner)

    def _replace(self, module_name: str) -> None:
        """Swap the complete module for its ``replace`` stand-in; nothing here keeps its old parameters alive."""
        parent_name, _, child = module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        setattr(parent, child, self.replace[module_name](getattr(parent, child)))
        for pname in [p for p in self.params if p.rpartition(".")[0] == module_name]:
            del self.params[pname]
        del self.pending[module_name]
        self.replaced.add(module_name)

    def check_complete(self) -> None:
        missing = sorted(self.expected - self.written)
        if missing:
            raise ValueError(f"weights: {len(missing)} tensor(s) missing from the checkpoint, e.g. "
                             f"{[f'{n} rows {s}:' if s else n for n, s in missing[:3]]}")


def _materialize(module: nn.Module, device: torch.device, keep: set[int] = frozenset()) -> None:
    """Allocate every parameter of ``module`` (but those whose id is in ``keep``) on ``device``, uninitialised; a
    shared parameter stays shared.  ``torch.empty`` from the shape and dtype, not ``module.to_empty``: its
    ``torch.empty_like`` on a meta tensor runs PyTorch's Python reference (``torch._refs``), whose import pulls in
    sympy and the symbolic-shape machinery, hundreds of modules held for the life of the process."""
    made: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for key, p in m._parameters.items():
            if p is None or id(p) in keep:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                           requires_grad=p.requires_grad)
            m._parameters[key] = made[id(p)]


def split_fused(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig):
    """A checkpoint that stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (Phi-3), as the
    separate projections the placements (and tensor-parallel cuts) are written for."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    parts = {"qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
             "gate_up_proj": (("gate_proj", inter), ("up_proj", inter))}
    for name, tensor in weights:
        prefix, _, rest = name.rpartition(".")
        prefix, _, module = prefix.rpartition(".")
        if module not in parts:
            yield name, tensor
            continue
        start = 0
        for part, rows in parts[module]:
            yield f"{prefix}.{part}.{rest}", tensor[start: start + rows]
            start += rows


@dataclass(frozen=True)
class _Cut:
    """This rank's part of a checkpoint tensor: ``size`` indices from ``start`` along ``dim`` (of ``full``)."""

    dim: int
    full: int
    start: int
    size: int


@dataclass(frozen=True)
class _Placement:
    """Where a checkpoint projection goes: ``module`` (our Linear), from its row ``row``, cut by ``cut``."""

    module: str
    row: int
    cut: _Cut
