"""Split K reduced inside the matmul kernels (kernels/_split_k.py): the last program of an output tile adds the
partials.  Each of the five split paths (4-bit GEMV, MMA and GEMM; int8-block GEMV and GEMM) against the separate
reduce launch it replaced (the capture fallback, still there) bit for bit, the counters left at zero, and on a GPU
the same inside a replayed CUDA graph."""

import dataclasses

import pytest
import torch

from anygpu.kernels import _split_k
from anygpu.kernels.launch import device_target, select

NF4 = torch.linspace(-1, 1, 16)
PATHS = ["4bit-gemv", "4bit-mma", "4bit-gemm", "int8-gemv", "int8-gemm"]


def _call(path, device, dtype, bias, split, big=False):
    """A function running ``path`` at ``split`` on fixed random inputs: M and N leave partial tiles (several of
    them), K an uneven share for split 3."""
    from anygpu.kernels import matmul_4bit as K4
    from anygpu.kernels import matmul_int8_block as K8

    g = torch.Generator().manual_seed(sum(map(ord, path)))
    kind, how = path.split("-")
    m = {"gemv": 1, "mma": 5, "gemm": 20}[how] * (2 if big and how == "gemm" else 1)
    n, k = (3000, 4096) if big else (80, 320 if how == "mma" else 512)  # (the interpreter's MMA is slow)
    target = device_target(device)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    if kind == "4bit":
        bs = 64
        w = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=g).to(device)
        absmax = (torch.rand(n * k // bs, generator=g) * 0.1 + 0.01).to(device)
        table = {"gemv": K4.GEMV_CONFIGS, "mma": K4.MMA_CONFIGS, "gemm": K4.GEMM_CONFIGS}[how]
        cfg = _in_kernel(next(c for c in select(table, target) if how != "gemm" or m <= c.constexprs["MAX_M"]))
        plan = K4.Plan(how, cfg, split)
        code = NF4.to(device)  # not inside the call: a copy from the CPU cannot be captured in a CUDA graph
        return lambda: K4.matmul_4bit(x, w, absmax, code, bs, n, k, b, plan_=plan)
    bs = 32
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g).to(device)
    scale = (torch.rand(n * k // bs, generator=g) * 0.002 + 0.0002).to(device)
    off = (scale.cpu() * 16 * (torch.rand(n * k // bs, generator=g) - 0.5)).to(device)
    table = {"gemv": K8.GEMV_CONFIGS, "gemm": K8.GEMM_CONFIGS}[how]
    cfg = _in_kernel(next(c for c in select(table, target) if how != "gemm" or m <= c.constexprs["MAX_M"]))
    plan = K8.Plan(how, cfg, split)
    return lambda: K8.matmul_int8_block(x, codes, scale, bs, b, off, plan_=plan)


def _in_kernel(cfg):
    """cfg with the in-kernel add on (a target's table may leave it off where the reduce launch measured faster)."""
    return dataclasses.replace(cfg, constexprs={**cfg.constexprs, "ADD_IN_KERNEL": True})


def _no_counters(monkeypatch):
    """Every launch takes the capture fallback: partials only, then the separate reduce launch."""
    monkeypatch.setattr(_split_k, "counters", lambda device, tiles: None)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,bias", [(torch.float16, True), (torch.bfloat16, False)])
def test_last_program_adds_the_partials_as_the_reduce_launch_did(kdevice, monkeypatch, path, dtype, bias):
    split = 3 if path.endswith("gemv") or path == "4bit-mma" else 2
    run = _call(path, kdevice, dtype, bias, split)
    with monkeypatch.context() as mp:
        _no_counters(mp)
        reduced = run()
    with monkeypatch.context() as mp:
        def no_second_launch(*args):
            raise AssertionError("the kernel should have added its partials itself")
        mp.setattr(_split_k, "reduce_partials", no_second_launch)
        first, second = run(), run()  # the second proves the first left its counters at 0
    assert _same_bits(first, reduced) and _same_bits(second, reduced)
    assert not _split_k._COUNTERS[first.device].any()
    # and at split 1, the direct store: the same sums up to rounding (another order)
    whole = _call(path, kdevice, dtype, bias, 1)()
    torch.testing.assert_close(whole.float(), reduced.float(), rtol=2e-2, atol=2e-2)


def test_counters_are_made_outside_capture_only_and_outgrown_ones_kept(monkeypatch):
    cuda = torch.device("cuda", 0)
    buf = torch.zeros(8, dtype=torch.int32)
    monkeypatch.setattr(_split_k, "_COUNTERS", {cuda: buf})
    monkeypatch.setattr(_split_k, "_OUTGROWN", [])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(_split_k, "_in_kernel_unproven", lambda device: False)  # an NVIDIA GPU
    assert _split_k.counters(cuda, 8) is buf
    assert _split_k.counters(cuda, 9) is None  # too small, and no allocation under capture
    assert _split_k._COUNTERS[cuda] is buf
    cpu = torch.device("cpu")
    grown = _split_k.counters(cpu, 3 * _split_k.MIN_COUNTERS)
    assert grown.numel() == 4 * _split_k.MIN_COUNTERS and not grown.any()
    assert _split_k.counters(cpu, 5 * _split_k.MIN_COUNTERS).numel() == 8 * _split_k.MIN_COUNTERS
    assert _split_k._OUTGROWN == [grown]  # a graph captured with it may still use its address


@pytest.mark.parametrize("arch,in_kernel", [("gfx942", False), ("gfx90a", False), ("gfx1100", False),
                                             ("sm_90", True), ("sm_80", True)])
def test_amd_gpus_keep_the_reduce_launch(monkeypatch, arch, in_kernel):
    """Faked device properties: the in-kernel add (its barrier + one release atomic) is for NVIDIA only."""
    from anygpu.backend.targets import parse_target_list

    (target,) = parse_target_list(arch)
    monkeypatch.setattr(_split_k, "device_target", lambda device: target)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _split_k._in_kernel_unproven.cache_clear()
    gpu = torch.device("cuda", 7)
    buf = torch.zeros(_split_k.MIN_COUNTERS, dtype=torch.int32)
    monkeypatch.setattr(_split_k, "_COUNTERS", {gpu: buf})
    try:
        assert (_split_k.counters(gpu, 4) is buf) == in_kernel
    finally:
        _split_k._in_kernel_unproven.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_eager_and_graph_replays_agree(monkeypatch, path, dtype):
    if path == "4bit-mma" and device_target(torch.device("cuda")).vendor != "nvidia":
        pytest.skip("the MMA path is NVIDIA's")
    dev = torch.device("cuda", torch.cuda.current_device())
    run = _call(path, dev, dtype, True, 4, big=True)
    eager = run()
    for _ in range(5):
        assert torch.equal(run(), eager)
    with monkeypatch.context() as mp:
        _no_counters(mp)
        assert _same_bits(run(), eager)  # the separate reduce launch: the same bits
    torch.cuda.synchronize()
    assert not _split_k._COUNTERS[dev].any()
    for fallback in (False, True):
        with monkeypatch.context() as mp:
            if fallback:  # captured before the device had counters: the separate reduce launch is captured instead
                mp.setattr(_split_k, "_COUNTERS", {})
            else:  # warm up on a side stream, as torch.cuda.graphs asks
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    run()
                torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = run()
            if fallback:
                assert _split_k._COUNTERS == {}  # nothing allocated under capture
            for _ in range(3):
                captured.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(captured, eager), f"a replay differs (fallback={fallback})"
    torch.cuda.synchronize()
    assert not _split_k._COUNTERS[dev].any()
