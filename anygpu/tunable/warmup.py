"""Tuning ahead of time: a model's linears (``tune_model``), a list of shapes, a model config, a recorded
untuned file.

``route(model)`` makes a model's ``nn.Linear`` layers call ``tunable.linear`` inside a ``with`` block.
TGI's warmup tunes the decode GEMMs at the batch sizes its CUDA graphs are captured for; ``tune_model``
does the same for every distinct (in, out, bias, dtype, device) linear of a model.  Tune before graph
capture: nothing is tuned while a stream is capturing.

Without the model in memory, ``decoder_linears(read_model_config(path))`` lists the linears of a
Llama-family decoder from its Hugging Face ``config.json``, as our engine runs them (fused projections).
Work for ``anygpu tune`` is a list of ``Problem`` s (``shape_problem``, ``untuned_problems``), each tuned
by ``tune_problem``; ``tunable/multi_device.py`` spreads such a list over several devices.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import torch
from torch import nn
from tqdm import tqdm

from .._progress import disabled
from . import controls, ops, quantized, results
from .signatures import Problem, linear_problem, parse_signatures

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def _plain_linears(model: nn.Module):
    """Linears with an ordinary [out, in] floating weight (quantized subclasses pack theirs)."""
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if (isinstance(module, nn.Linear) and isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_floating_point()
                and tuple(w.shape) == (module.out_features, module.in_features)):
            yield name, module


@contextlib.contextmanager
def route(model: nn.Module):
    """Inside the block, ``model``'s ``nn.Linear`` layers run through ``tunable.linear``, and the 4-bit and
    int8 matmuls (of any model: the kernels' hooks are global) take tuned plans."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    patched = []
    for _, module in _plain_linears(model):
        if "forward" in module.__dict__:
            continue  # already routed (nested route) or patched by someone else: leave it
        module.forward = _routed_forward(module)
        patched.append(module)
    try:
        with quantized.installed():
            yield model
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)


def _routed_forward(module: nn.Linear):
    def forward(x):
        return ops.linear(x, module.weight, module.bias)

    return forward


def tune_model(model: nn.Module, batch_sizes=DEFAULT_BATCH_SIZES, progress: bool = True) -> list[Problem]:
    """Tune every distinct linear of ``model`` at ``batch_sizes`` tokens; returns the problems now decided."""
    sizes = tuple(batch_sizes) if not isinstance(batch_sizes, int) else (batch_sizes,)
    if not sizes or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in sizes):
        raise ValueError(f"batch_sizes: expected positive ints, got {batch_sizes!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    shapes = {}
    for _, module in _plain_linears(model):
        w, b = module.weight, module.bias
        shapes.setdefault((w.shape[1], w.shape[0], b is not None, w.dtype, w.device), module)
    work = [(m, module) for module in shapes.values() for m in sizes]
    quantized_work = [(m, module) for module in _quantized_linears(model) for m in sizes]
    done = []
    with controls.settings(enabled=True, tuning=True), torch.no_grad():
        for m, module in tqdm(work, desc="tuning linears", unit="shape", disable=disabled(progress)):
            x = torch.randn(m, module.in_features, dtype=module.weight.dtype, device=module.weight.device)
            ops.linear(x, module.weight, module.bias)
            done.append(linear_problem(x, module.weight, module.bias is not None))
        # 4-bit and int8 layers: a forward at each size asks the kernels' plan, which the tuner answers (GPU
        # only: on the CPU they run the PyTorch reference, which has no plan).
        with quantized.installed():
            for m, module in tqdm(quantized_work, desc="tuning quantized linears", unit="shape",
                                  disable=disabled(progress) or not quantized_work):
                module(torch.randn(m, module.in_features, dtype=_input_dtype(module), device=module.weight.device))
    return done


def _quantized_linears(model: nn.Module):
    """One module per distinct (kind, in, out, input dtype, device) among 4-bit (``Params4bit``, which has a
    ``quant_state``) and int8 (``Int8Params``, with ``SCB``) linears on a GPU."""
    seen = {}
    for _, module in model.named_modules():
        w = getattr(module, "weight", None)
        kind = "4bit" if getattr(w, "quant_state", None) is not None else "int8" if getattr(w, "SCB", None) is not None \
            else None
        if kind and w.device.type == "cuda" and hasattr(module, "in_features"):
            seen.setdefault((kind, module.in_features, module.out_features, _input_dtype(module), w.device), module)
    return list(seen.values())


def _input_dtype(module: nn.Module) -> torch.dtype:
    """What the layer computes in: its compute dtype, else the dtype it was quantized from, else fp16."""
    state = getattr(module.weight, "quant_state", None)
    return getattr(module, "compute_dtype", None) or getattr(state, "dtype", None) or torch.float16


def tune_shapes(shapes, dtype: torch.dtype, device: torch.device, bias: bool = False,
                progress: bool = True) -> list[tuple[Problem, results.Entry]]:
    """Tune ``F.linear(x[M, K], W[N, K])`` for each ``(M, N, K)``; returns each problem and its entry."""
    out = []
    with controls.settings(enabled=True, tuning=True), torch.no_grad():
        for m, n, k in tqdm(list(shapes), desc="tuning", unit="shape", disable=disabled(progress)):
            if min(m, n, k) < 1:
                raise ValueError(f"shapes: expected positive M,N,K, got {(m, n, k)}")
            x = torch.randn(m, k, dtype=dtype, device=device)
            w = torch.randn(n, k, dtype=dtype, device=device) / math.sqrt(k)
            b = torch.randn(n, dtype=dtype, device=device) if bias else None
            ops.linear(x, w, b)
            problem = linear_problem(x, w, bias)
            out.append((problem, ops.table(max(device.index or 0, 0))[problem]))
    return out


def _operand(rows: int, cols: int, trans: str, ld: int, batch: int, dtype, device) -> torch.Tensor:
    """A row-major-math [batch,] rows x cols operand with the BLAS layout a file line names."""
    strides = (ld, 1) if trans == "n" else (1, ld)
    per_matrix = (rows - 1) * strides[0] + (cols - 1) * strides[1] + 1
    storage = torch.randn(batch * per_matrix, dtype=dtype, device=device) / math.sqrt(max(cols, rows))
    if batch == 1:
        return storage.as_strided((rows, cols), strides)
    return storage.as_strided((batch, rows, cols), (per_matrix, *strides))


def shape_problem(m: int, n: int, k: int, dtype: torch.dtype, bias: bool = False) -> Problem:
    """The GEMM of ``F.linear(x[M, K], W[N, K])`` (plus a bias): what ``tune_shapes`` tunes for ``(M, N, K)``."""
    if min(m, n, k) < 1:
        raise ValueError(f"shapes: expected positive M,N,K, got {(m, n, k)}")
    x, w = torch.empty(m, k, dtype=dtype, device="meta"), torch.empty(n, k, dtype=dtype, device="meta")
    return linear_problem(x, w, bias)


def untuned_problems(path: str) -> list[Problem]:
    """The GEMMs an untuned file records, in file order without repeats; lines for ops we do not tune are
    skipped.  ValueError when the file does not exist."""
    recorded = results.read(path, None)
    if recorded is None:
        raise ValueError(f"path: expected an untuned file written with record-untuned on, {path!r} does not exist")
    return list(dict.fromkeys(p for p in (parse_signatures(*key) for key in recorded.entries) if p is not None))


def tune_problem(p: Problem, device: torch.device) -> results.Entry:
    """Tune one GEMM on ``device`` (or find it in the results file) through the entry point that makes it;
    returns its entry.  Raises what the GEMM raises (an allocation that fails, a device error)."""
    with controls.settings(enabled=True, tuning=True, record_untuned=False), torch.no_grad():
        # Our A [M, K] is BLAS's B (trans_b, ldb); our B [K, N] is BLAS's A (trans_a, lda).  M = p.n, N = p.m.
        a = _operand(p.n, p.k, p.trans_b, p.ldb, p.batch, p.dtype, device)
        b = _operand(p.k, p.m, p.trans_a, p.lda, p.batch, p.dtype, device)
        if p.family == "GemmStridedBatched":
            ops.bmm(a, b)
        elif p.family == "GemmAndBias":
            ops.linear(a, b.t(), torch.randn(p.m, dtype=p.dtype, device=device))
        else:
            ops.mm(a, b)
        entry = ops.table(max(device.index or 0, 0)).get(p)
    if entry is None:  # tuning is forced on above: only CPU tensors under a GPU backend or a capture skip it
        raise RuntimeError(f"{p.op_signature()},{p.params_signature()} was not tuned on {device} (a CPU device "
                           "under a GPU backend is never tuned, nor is anything while a CUDA graph captures)")
    return entry


def tune_untuned_file(path: str, device: torch.device, progress: bool = True) -> list[tuple[Problem, str]]:
    """Tune every GEMM an untuned file records (``ANYGPU_TUNABLEOP_RECORD_UNTUNED=1``); returns each problem
    and its winning solution.  Lines for ops we do not tune are skipped."""
    problems = untuned_problems(path)
    return [(p, tune_problem(p, device).solution)
            for p in tqdm(problems, desc="tuning", unit="gemm", disable=disabled(progress))]


# --- a model config: the linears of a Llama-family decoder -------------------------------------------------

_MISSING = object()
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def read_model_config(path) -> dict:
    """A Hugging Face ``config.json`` (``path`` is the file or a directory holding it) as a dict; a
    multimodal config's ``text_config`` when the top level has no ``hidden_size``.  ValueError naming the
    file when it is missing or not a JSON object."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"model config: {file} does not exist (expected a config.json or a directory holding "
                         "one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model config: cannot read {file} as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"model config: {file}: expected a JSON object, got {type(config).__name__}")
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    return config


def _int_key(config: dict, key: str, default=_MISSING) -> int:
    value = config.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"model config: missing key {key!r} (a Llama-family config.json has it)")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model config: {key}: expected a positive integer, got {value!r}")
    return value


def _bool_key(config: dict, key: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"model config: {key}: expected true or false, got {value!r}")
    return value


def config_dtype(config: dict) -> torch.dtype | None:
    """The dtype a config names (``torch_dtype``, or ``dtype`` in newer transformers), when we tune it."""
    name = config.get("torch_dtype", config.get("dtype"))
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(name)


def decoder_linears(config: dict) -> list[tuple[str, int, int, bool]]:
    """``(name, out_features, in_features, bias)`` of each linear of a Llama-family decoder, as our engine
    runs them: q, k and v fused into ``qkv_proj``, gate and up into ``gate_up_proj`` (separate q/k/v or
    gate/up GEMMs are not listed), then ``o_proj``, ``down_proj`` and ``lm_head``.

    Keys: ``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``vocab_size`` (required);
    ``num_key_value_heads`` (default: no GQA), ``head_dim`` (default hidden_size / heads),
    ``attention_bias`` (Llama: q, k, v and o; default on for q, k, v of ``model_type`` qwen2), ``mlp_bias``,
    ``tie_word_embeddings`` (checked only: a tied lm_head is the same GEMM on the embedding matrix).
    ValueError naming the key that is missing or wrong; mixture-of-experts configs are refused."""
    if not isinstance(config, dict):
        raise ValueError(f"config: expected a dict (a parsed config.json), got {type(config).__name__}")
    for key in MOE_KEYS:
        if isinstance(config.get(key), int) and config[key] > 1:
            raise ValueError(f"model config: {key}={config[key]}: mixture-of-experts models are not supported "
                             "(their expert GEMMs are grouped)")
    hidden = _int_key(config, "hidden_size")
    intermediate = _int_key(config, "intermediate_size")
    heads = _int_key(config, "num_attention_heads")
    vocab = _int_key(config, "vocab_size")
    kv_heads = _int_key(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"model config: num_key_value_heads: expected a divisor of num_attention_heads ({heads}), "
                         f"got {kv_heads}")
    if config.get("head_dim") is None and hidden % heads:
        raise ValueError(f"model config: head_dim is absent and hidden_size ({hidden}) is not a multiple of "
                         f"num_attention_heads ({heads})")
    head_dim = _int_key(config, "head_dim", hidden // heads)
    qwen2 = config.get("model_type") == "qwen2"
    attention_bias = _bool_key(config, "attention_bias", False)
    mlp_bias = _bool_key(config, "mlp_bias", False)
    _bool_key(config, "tie_word_embeddings", False)
    return [
        ("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden, attention_bias or qwen2),
        ("o_proj", hidden, heads * head_dim, attention_bias),
        ("gate_up_proj", 2 * intermediate, hidden, mlp_bias),
        ("down_proj", hidden, intermediate, mlp_bias),
        ("lm_head", vocab, hidden, False),
    ]
