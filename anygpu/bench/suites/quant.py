"""bitsandbytes-compatible quantization against bitsandbytes itself and a copy of the same bytes.

Quantize and dequantize are memory bound: each reads its input once and writes its output once, so
the copy is the bar (the target is 80% of it).  Cases: 8-bit blockwise at block sizes 4096 (the
default) and 256, and NF4 at 64 (the QLoRA default), on LLM weights in bf16.

The suite is a list of case builders, ``(device, quick) -> list[Case]``; more (the 4-bit matmul) are
added by decorating them with ``@case_builder``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...quant import functional as Q
from ..harness import Case, baseline, suite

# [out_features, in_features]: Llama-3-8B/70B attention (8192 x 8192) and Llama-3-70B's MLP up (28672 x 8192).
GPU_WEIGHTS = ((8192, 8192), (28672, 8192))
# The CPU runs the PyTorch reference: small fp32 weights keep it quick.
SMALL_WEIGHTS = ((512, 512), (1024, 2048))

CASE_BUILDERS: list[Callable[[torch.device, bool], list[Case]]] = []


def case_builder(fn: Callable[[torch.device, bool], list[Case]]):
    """Add ``fn(device, quick) -> list[Case]`` to the quant suite."""
    CASE_BUILDERS.append(fn)
    return fn


@suite("quant", "8-bit blockwise and NF4 quantize / dequantize, NF4 matmul, against bitsandbytes, F.linear and a copy")
def quant(device: torch.device, quick: bool) -> list[Case]:
    return [case for build in CASE_BUILDERS for case in build(device, quick)]


def _bitsandbytes():
    """bitsandbytes.functional, or None when it is not installed."""
    try:
        import bitsandbytes.functional as bnb_functional
    except Exception:  # noqa: BLE001 - missing, or installed without a library for this machine
        return None
    return bnb_functional


def _copy(nbytes: int, device: torch.device) -> Callable[[], object]:
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device=device)  # copy_ reads src, writes dst
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _weights(device: torch.device, quick: bool):
    small = quick or device.type == "cpu"
    dtype = torch.float32 if small else torch.bfloat16
    for rows, cols in SMALL_WEIGHTS if small else GPU_WEIGHTS:
        label = f"{rows}x{cols} {str(dtype).removeprefix('torch.')}"
        yield torch.randn(rows, cols, dtype=dtype, device=device) * 0.02, label


@case_builder
def blockwise_cases(device: torch.device, quick: bool) -> list[Case]:
    bnb = _bitsandbytes()
    cases = []
    for weight, label in _weights(device, quick):
        n = weight.numel()
        for blocksize in (4096, 256):
            absmax_bytes = 4 * -(-n // blocksize)
            codes, state = Q.quantize_blockwise(weight, blocksize=blocksize)
            quantize_bytes = weight.nbytes + n + absmax_bytes
            dequantize_bytes = n + absmax_bytes + weight.nbytes
            baselines_q = {"copy": _copy(quantize_bytes, device)}
            baselines_d = {"copy": _copy(dequantize_bytes, device)}
            if bnb is not None:
                baselines_q["bitsandbytes"] = baseline(
                    lambda w=weight, bs=blocksize: (lambda: bnb.quantize_blockwise(w, blocksize=bs)))
                baselines_d["bitsandbytes"] = baseline(
                    lambda w=weight, bs=blocksize: _bnb_dequantize_blockwise(bnb, w, bs))
            shape = f"{label} bs{blocksize}"
            cases.append(Case("quantize_blockwise", shape,
                              lambda w=weight, bs=blocksize: Q.quantize_blockwise(w, blocksize=bs),
                              baselines_q, bytes=quantize_bytes))
            cases.append(Case("dequantize_blockwise", shape, lambda c=codes, s=state: Q.dequantize_blockwise(c, s),
                              baselines_d, bytes=dequantize_bytes))
    return cases


def _bnb_dequantize_blockwise(bnb, weight: torch.Tensor, blocksize: int):
    codes, state = bnb.quantize_blockwise(weight, blocksize=blocksize)
    return lambda: bnb.dequantize_blockwise(codes, state)


def _bnb_dequantize_4bit(bnb, weight: torch.Tensor, blocksize: int):
    packed, state = bnb.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4")
    return lambda: bnb.dequantize_4bit(packed, state)


@case_builder
def nf4_cases(device: torch.device, quick: bool) -> list[Case]:
    bnb = _bitsandbytes()
    blocksize = 64
    cases = []
    for weight, label in _weights(device, quick):
        n = weight.numel()
        packed, state = Q.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4")
        absmax_bytes = 4 * -(-n // blocksize)
        quantize_bytes = weight.nbytes + (n + 1) // 2 + absmax_bytes
        dequantize_bytes = (n + 1) // 2 + absmax_bytes + weight.nbytes
        baselines_q = {"copy": _copy(quantize_bytes, device)}
        baselines_d = {"copy": _copy(dequantize_bytes, device)}
        if bnb is not None:
            baselines_q["bitsandbytes"] = baseline(
                lambda w=weight: (lambda: bnb.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")))
            baselines_d["bitsandbytes"] = baseline(lambda w=weight: _bnb_dequantize_4bit(bnb, w, blocksize))
        shape = f"{label} bs{blocksize}"
        cases.append(Case("quantize_nf4", shape,
                          lambda w=weight: Q.quantize_4bit(w, blocksize=blocksize, quant_type="nf4"),
                          baselines_q, bytes=quantize_bytes))
        cases.append(Case("dequantize_nf4", shape, lambda p=packed, s=state: Q.dequantize_4bit(p, s),
                          baselines_d, bytes=dequantize_bytes))
    return cases


# (N, K) of the 4-bit matmul cases and the rows of x: decode (1), batched decode (2 to 256: every bucket of the
# kernel's plan), a prefill (4096).  The other shapes and dtypes take the rows where the targets are named.
MATMUL_WEIGHTS = ((8192, 8192), (28672, 8192), (8192, 28672))
MATMUL_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 4096)
MATMUL_ROWS_OTHER_SHAPES = (1, 16, 64, 256, 4096)


def _bnb_matmul_4bit(weight: torch.Tensor, x: torch.Tensor, compress: bool):
    import bitsandbytes

    packed, state = bitsandbytes.functional.quantize_4bit(weight, blocksize=64, quant_type="nf4",
                                                          compress_statistics=compress)
    return lambda: bitsandbytes.matmul_4bit(x, packed.t(), quant_state=state)


@case_builder
def matmul_4bit_cases(device: torch.device, quick: bool) -> list[Case]:
    """NF4 ``x @ W.T`` against fp16/bf16 ``F.linear`` on the unquantized weight and bitsandbytes."""
    from ...quant.matmul import matmul_4bit

    small = quick or device.type == "cpu"
    bnb = _bitsandbytes()
    cases = []
    for (n, k), dtype in [((512, 512), torch.float32)] if small else [
            (nk, dt) for dt in (torch.float16, torch.bfloat16) for nk in MATMUL_WEIGHTS]:
        weight = torch.randn(n, k, dtype=dtype, device=device) * 0.02
        for compress in (False, True):
            packed, state = Q.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=compress)
            weight_bytes = packed.nbytes + state.absmax.nbytes + (state.state2.absmax.nbytes if compress else 0)
            first = (n, k) == MATMUL_WEIGHTS[0] and dtype == torch.float16
            for m in (1, 16) if small else MATMUL_ROWS if first else MATMUL_ROWS_OTHER_SHAPES:
                if compress and (m == 4096 or (n, k) != MATMUL_WEIGHTS[0]):
                    continue  # double quant only where its decode cost shows: small batches, one shape
                x = torch.randn(m, k, dtype=dtype, device=device)
                baselines = {"F.linear": lambda x=x, w=weight: torch.nn.functional.linear(x, w)}
                if bnb is not None and not small:
                    baselines["bitsandbytes"] = baseline(lambda w=weight, x=x, c=compress: _bnb_matmul_4bit(w, x, c))
                label = f"M={m} {n}x{k} {str(dtype).removeprefix('torch.')}{' dq' if compress else ''}"
                cases.append(Case("matmul_nf4", label, lambda x=x, p=packed, s=state: matmul_4bit(x, p, s),
                                  baselines, bytes=weight_bytes + x.nbytes + m * n * x.element_size(),
                                  flops=2 * m * n * k, graph=m <= 256))
    return cases


# GGUF's Q4_K in the 4-bit matmul's layout (quant/gguf_4bit.py: codes (q - 8) / 8, a scale and offset per 32, fp16
# for bf16 weights): the decode shapes of a Q4_K_M model's 4-bit projections.  ANYGPU_LINEAR_4BIT=1 (the default)
# / 0 picks the decoder (arithmetic / table), so two runs compare them.
Q4K_ROWS = (1, 16, 64)


@case_builder
def matmul_q4_k_cases(device: torch.device, quick: bool) -> list[Case]:
    """GGUF Q4_K ``x @ W.T`` (the op ``GGUF4bitLinear`` calls) against ``F.linear`` on the unquantized weight."""
    from ...ops import matmul_4bit
    from ...quant import gguf_4bit

    small = quick or device.type == "cpu"
    dtype = torch.float32 if small else torch.bfloat16
    cases = []
    for n, k in [(256, 512)] if small else MATMUL_WEIGHTS:
        weight = torch.randn(n, k, dtype=dtype, device=device) * 0.02
        # the layer's form for 16-bit activations (GGUF4bitLinear.from_linear): fp16 scales where they fit
        w = gguf_4bit.convert(gguf_4bit.quantize_q4_k(weight).reshape(-1), "Q4_K", n, k,
                              half_scales=dtype != torch.float32)
        weight_bytes = w.packed.nbytes + w.absmax.nbytes + w.offset.nbytes
        for m in (1, 16) if small else Q4K_ROWS:
            x = torch.randn(m, k, dtype=dtype, device=device)
            cases.append(Case("matmul_q4_k", f"M={m} {n}x{k} {str(dtype).removeprefix('torch.')}",
                              lambda x=x, w=w, n=n, k=k: matmul_4bit(x, w.packed, w.absmax, w.code, gguf_4bit.BLOCKSIZE,
                                                                      n, k, offset=w.offset),
                              {"F.linear": lambda x=x, wt=weight: torch.nn.functional.linear(x, wt)},
                              bytes=weight_bytes + x.nbytes + m * n * x.element_size(), flops=2 * m * n * k,
                              graph=True))
    return cases
