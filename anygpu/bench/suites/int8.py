"""LLM.int8(): ``Linear8bitLt`` at threshold 6.0 (the LLM.int8() default) against fp16 ``F.linear`` on the
same weight and bitsandbytes' ``Linear8bitLt``, in the same run.

Cases: N = K = 8192 (a Llama-3-70B attention projection) in fp16, M = 1, 16, 64 and 256 (decode and batched
decode: timed as CUDA / HIP graph replays, as the engine's decode steps run them) and M = 4096 (a prefill,
launched from Python), with a few outlier columns
planted in x as LLM activations have them (8 columns, every third row), so the mixed decomposition runs.
Targets (issue 4): ours at least 1.6x (M = 1), 1.5x (M = 16) and 1.3x (M = 4096) faster than fp16
``F.linear``.  bitsandbytes cannot be captured in a graph at threshold > 0 (it reads the outlier columns
back to the host), so its decode numbers are in extra ``linear8bit eager`` rows, where every call is
launched from Python (ours and ``F.linear`` too).  On GPUs with Triton, rows ``int8_matmul[path]`` time each of the kernels' other paths
(``kernels.int8_matmul.PATHS``) on the same problem: what ``PATH_LIMITS`` and the config tables are
chosen from.

``quick`` and the CPU: N = K = 512 in fp32 (the PyTorch reference runs there), M = 1, 16, 64; no
bitsandbytes baseline (its CPU path is a different algorithm and slow).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ...nn import Linear8bitLt
from ..harness import Case, baseline, suite

THRESHOLD = 6.0
GPU_NK, GPU_ROWS = (8192, 8192), (1, 16, 64, 256, 4096)
GRAPH_ROWS = 256  # up to this many rows a call is a decode step's: timed as graph replays
SMALL_NK, SMALL_ROWS = (512, 512), (1, 16, 64)
OUTLIER_COLUMNS = 8


@suite("int8", "LLM.int8() Linear8bitLt (threshold 6) vs fp16 F.linear and bitsandbytes")
def int8_suite(device: torch.device, quick: bool) -> list[Case]:
    small = quick or device.type == "cpu"
    (n, k), rows = (SMALL_NK, SMALL_ROWS) if small else (GPU_NK, GPU_ROWS)
    dtype = torch.float32 if small else torch.float16
    generator = torch.Generator().manual_seed(0)
    source = nn.Linear(k, n, dtype=dtype)
    with torch.no_grad():
        source.weight.normal_(0, k**-0.5, generator=generator)
        source.bias.normal_(0, 0.1, generator=generator)
    source = source.to(device).requires_grad_(False)
    layer = Linear8bitLt.from_linear(source, threshold=THRESHOLD).requires_grad_(False)
    bnb_layer = None if small else baseline(lambda: _bnb_layer(source, device))
    paths = _kernel_paths(device) if not small else None
    cases = []
    for m in rows:
        x = _activations(m, k, dtype, device, generator)
        weight_bytes = layer.weight.numel() + layer.weight.SCB.nbytes + source.bias.nbytes
        nbytes = weight_bytes + x.nbytes + m * n * x.element_size()
        label = f"M={m} {n}x{k} {str(dtype).removeprefix('torch.')} t={THRESHOLD:g}"
        baselines = {f"F.linear {str(dtype).removeprefix('torch.')}": lambda x=x: F.linear(x, source.weight, source.bias)}
        if bnb_layer is not None:
            baselines["bitsandbytes"] = _uncapturable if m <= GRAPH_ROWS else (lambda x=x: bnb_layer(x))
        cases.append(Case("linear8bit", label, lambda x=x: layer(x), baselines, bytes=nbytes, flops=2 * m * n * k,
                          graph=m <= GRAPH_ROWS))
        if bnb_layer is not None and m <= 16:  # bitsandbytes only runs eagerly: compare there too
            cases.append(Case("linear8bit eager", label, lambda x=x: layer(x),
                              {**baselines, "bitsandbytes": lambda x=x: bnb_layer(x)}, bytes=nbytes,
                              flops=2 * m * n * k))
        for path in paths or ():
            run = _path_runner(path, x, layer, source)
            if run is not None:
                cases.append(Case(f"int8_matmul[{path}]", label, run, {}, bytes=nbytes, flops=2 * m * n * k,
                                  graph=m <= GRAPH_ROWS))
    return cases


def _activations(m: int, k: int, dtype: torch.dtype, device: torch.device, generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=generator)
    cols = torch.randperm(k, generator=generator)[:OUTLIER_COLUMNS]
    signs = torch.randint(0, 2, (m, OUTLIER_COLUMNS), generator=generator) * 2 - 1
    values = signs * (THRESHOLD + 6 * torch.rand(m, OUTLIER_COLUMNS, generator=generator))
    x[::3, cols] = values[::3]
    return x.to(dtype).to(device)


def _bnb_layer(source: nn.Linear, device: torch.device):
    import bitsandbytes

    layer = bitsandbytes.nn.Linear8bitLt(source.in_features, source.out_features, bias=True, has_fp16_weights=False,
                                         threshold=THRESHOLD)
    layer.load_state_dict({k: v.cpu() for k, v in source.state_dict().items()})
    return layer.to(device).eval().requires_grad_(False)


def _uncapturable():
    """The bitsandbytes baseline of a graph-timed row: its Linear8bitLt reads its outlier columns back to the host
    (``torch.argwhere``), which a CUDA graph cannot capture, so say so at once (in the warm-up, before a capture
    that would end empty) instead of trying; the ``linear8bit eager`` rows time it."""
    raise RuntimeError("bitsandbytes' Linear8bitLt syncs with the host at threshold > 0: not capturable in a CUDA "
                       "graph (see the 'linear8bit eager' row)")


def _kernel_paths(device: torch.device):
    if device.type != "cuda":
        return None
    from ...kernels import HAS_TRITON

    if not HAS_TRITON:
        return None
    from ...kernels.int8_matmul import PATHS

    return PATHS


def _path_runner(path: str, x: torch.Tensor, layer: Linear8bitLt, source: nn.Linear):
    """A call of the kernels' ``path`` on this problem, or None where the path does not take it, fails here,
    or is the one ``plan`` picks anyway (the linear8bit row times that)."""
    from ...kernels.int8_matmul import int8_matmul, plan, plan_for

    m, k = x.shape
    n = layer.out_features
    try:
        chosen = plan_for(path, m, n, k, x.device)
    except ValueError:
        return None
    if plan(m, n, k, x.dtype, x.device).path == path:
        return None
    weight, scb, bias = layer.weight.data, layer.weight.SCB, source.bias

    def run():
        return int8_matmul(x, weight, scb, THRESHOLD, bias, plan_=chosen)

    try:  # a path this GPU cannot run (torch._int_mm without hipBLASLt's int8, say) is left out, not fatal
        run()
        torch.cuda.synchronize(x.device)
    except Exception:  # noqa: BLE001
        return None
    return run
