"""Tuning ahead of time: a model's linears (``tune_model``), a list of shapes, a recorded untuned file.

``route(model)`` makes a model's ``nn.Linear`` layers call ``tunable.linear`` inside a ``with`` block.
TGI's warmup tunes the decode GEMMs at the batch sizes its CUDA graphs are captured for; ``tune_model``
does the same for every distinct (in, out, bias, dtype, device) linear of a model.  Tune before graph
capture: nothing is tuned while a stream is capturing.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from tqdm import tqdm

from . import controls, ops, results
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
    """Inside the block, ``model``'s ``nn.Linear`` layers run through ``tunable.linear``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    patched = []
    for _, module in _plain_linears(model):
        if "forward" in module.__dict__:
            continue  # already routed (nested route) or patched by someone else: leave it
        module.forward = _routed_forward(module)
        patched.append(module)
    try:
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
    done = []
    with controls.settings(enabled=True, tuning=True), torch.no_grad():
        for m, module in tqdm(work, desc="tuning linears", unit="shape", disable=not progress):
            x = torch.randn(m, module.in_features, dtype=module.weight.dtype, device=module.weight.device)
            ops.linear(x, module.weight, module.bias)
            done.append(linear_problem(x, module.weight, module.bias is not None))
    return done


def tune_shapes(shapes, dtype: torch.dtype, device: torch.device, bias: bool = False,
                progress: bool = True) -> list[tuple[Problem, results.Entry]]:
    """Tune ``F.linear(x[M, K], W[N, K])`` for each ``(M, N, K)``; returns each problem and its entry."""
    out = []
    with controls.settings(enabled=True, tuning=True), torch.no_grad():
        for m, n, k in tqdm(list(shapes), desc="tuning", unit="shape", disable=not progress):
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


def tune_untuned_file(path: str, device: torch.device, progress: bool = True) -> list[tuple[Problem, str]]:
    """Tune every GEMM an untuned file records (``ANYGPU_TUNABLEOP_RECORD_UNTUNED=1``); returns each problem
    and its winning solution.  Lines for ops we do not tune are skipped."""
    recorded = results.read(path, None)
    if recorded is None:
        raise ValueError(f"path: expected an untuned file written with record-untuned on, {path!r} does not exist")
    problems = [p for p in (parse_signatures(*key) for key in recorded.entries) if p is not None]
    out = []
    with controls.settings(enabled=True, tuning=True, record_untuned=False), torch.no_grad():
        for p in tqdm(problems, desc="tuning", unit="gemm", disable=not progress):
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
            out.append((p, entry.solution if entry else "Default"))
    return out
