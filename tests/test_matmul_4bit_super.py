"""4-bit matmul with K-quant super-block scales (``super_scales``: uint8 absmax and offset, multiples of two fp32
units per 8 blocks, Q4_K's form in ``quant/gguf_4bit.py``): every kernel path equals the same kernel path given the
expanded fp32 scales and offsets bit for bit (the same values, summed in the same order), and the reference; the
op's checks, autograd and meta."""

import pytest
import torch

from anygpu.ops import matmul_4bit
from anygpu.ops.matmul_4bit import dequantize_weight, super_block_scales

CODE = (torch.arange(16, dtype=torch.float32) - 8) / 8  # GGUF's Q4 table as gguf_4bit centres it


def make_weight(n, k, device="cpu", seed=0):
    """Random codes, 6-bit scale and minimum multiples, and super-block units as fp16 values (Q4_K's 8 d, dmin)."""
    g = torch.Generator().manual_seed(n * 7 + k + seed)
    blocks = n * k // 32
    w = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=g)
    sc = torch.randint(0, 64, (blocks,), dtype=torch.uint8, generator=g)
    mn = torch.randint(0, 64, (blocks,), dtype=torch.uint8, generator=g)
    d = (torch.rand(blocks // 8, generator=g) * 2e-3 + 1e-4).half().float()
    dmin = (torch.rand(blocks // 8, generator=g) * 1e-3).half().float()
    units = torch.stack([8 * d, dmin], dim=1)
    return w.to(device), sc.to(device), mn.to(device), units.to(device)


def test_reference_decodes_the_super_block_form():
    n, k = 4, 512
    w, sc, mn, units = make_weight(n, k)
    scale, offset = super_block_scales(sc, mn, units)
    b = torch.arange(n * k // 32) // 8
    assert torch.equal(scale, sc.float() * units[b, 0])  # exact products
    assert torch.equal(offset, scale - mn.float() * units[b, 1])
    want = dequantize_weight(w, scale, CODE, 32, n, k, torch.float32, offset=offset)
    assert torch.equal(dequantize_weight(w, sc, CODE, 32, n, k, torch.float32, offset=mn, super_scales=units), want)
    x = torch.randn(3, k)
    torch.testing.assert_close(matmul_4bit(x, w, sc, CODE, 32, n, k, offset=mn, super_scales=units), x @ want.T)


CASES = [  # m, n, k, bias
    (1, 40, 512, True),
    (1, 33, 768, False),  # K not a multiple of the GEMV's longer steps
    (3, 24, 256, True),
    (17, 70, 512, False),  # the GEMM's folded steps of several blocks
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,bias", CASES)
@pytest.mark.parametrize("with_offset", [True, False])
def test_kernel_paths_equal_the_expanded_form(kdevice, dtype, m, n, k, bias, with_offset):
    from anygpu.kernels.launch import LaunchConfig, device_target
    from anygpu.kernels.matmul_4bit import GEMM_CONFIGS, GEMV_CONFIGS, MMA_CONFIGS, Plan, matmul_4bit as kernel, select

    target = device_target(kdevice)
    w, sc, mn, units = make_weight(n, k, kdevice)
    mn = mn if with_offset else None
    scale, offset = super_block_scales(sc, mn, units)
    code = CODE.to(kdevice)
    x = torch.randn(m, k, device=kdevice).to(dtype)
    b = torch.randn(n, device=kdevice).to(dtype) if bias else None
    gemv = select(GEMV_CONFIGS, target)[0]
    small_steps = LaunchConfig({**gemv.constexprs, "CHUNK": 32, "PREFETCH": False}, gemv.num_warps)
    plans = [Plan("gemv", gemv, s) for s in (1, 3)] + [Plan("gemv", small_steps, 2)] if m <= 3 else []
    plans += [Plan("mma", select(MMA_CONFIGS, target)[0], 2)]  # no super-block term there: the GEMM takes it
    plans += [Plan("gemm", cfg, s) for cfg in select(GEMM_CONFIGS, target) for s in (1, 2)] + [Plan("dequant")]
    first = select(GEMM_CONFIGS, target)[0]
    plans.append(Plan("gemm", LaunchConfig({**first.constexprs, "BLOCK_K": 256, "FOLD_SCALE": True},
                                           first.num_warps, first.num_stages), 2))
    wd = dequantize_weight(w, scale, code, 32, n, k, torch.float32, offset=offset)
    oracle = torch.nn.functional.linear(x.float(), wd, None if b is None else b.float())
    for plan in plans:
        what = f"{plan.path} split={plan.split_k} {dtype}"
        y = kernel(x, w, sc, code, 32, n, k, b, offset=mn, super_scales=units, plan_=plan)
        assert y.shape == (m, n) and y.dtype == dtype
        if plan.path != "mma":  # (which has no blocks of 32 itself: the launcher hands the call to the GEMM)
            assert torch.equal(y, kernel(x, w, scale, code, 32, n, k, b, offset=offset, plan_=plan)), what
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(y.float(), oracle, rtol=tol, atol=tol * oracle.abs().max().item(), msg=what)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m", [1, 4, 16, 80])
def test_op_equals_the_expanded_form_on_every_path(device, m):
    """The op as GGUF4bitLinear calls it (the plan's choice), at a model-like shape on a GPU."""
    n, k = (1024, 4096) if device == "cuda" else (96, 512)
    w, sc, mn, units = make_weight(n, k, device)
    scale, offset = super_block_scales(sc, mn, units)
    code = CODE.to(device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    y = matmul_4bit(x, w, sc, code, 32, n, k, offset=mn, super_scales=units)
    assert torch.equal(y, matmul_4bit(x, w, scale, code, 32, n, k, offset=offset)), f"m={m}"


def test_opcheck_gradient_and_meta():
    w, sc, mn, units = make_weight(24, 256)
    x = torch.randn(5, 256, dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(matmul_4bit.overload, (x, w, sc, CODE, 32, 24, 256, None, None, None, None, mn, units))
    x32 = torch.randn(3, 256, requires_grad=True)
    y = matmul_4bit(x32, w, sc, CODE, 32, 24, 256, offset=mn, super_scales=units)
    g = torch.randn_like(y)
    y.backward(g)
    wd = dequantize_weight(w, sc, CODE, 32, 24, 256, torch.float32, offset=mn, super_scales=units)
    torch.testing.assert_close(x32.grad, g @ wd)
    meta = matmul_4bit(torch.empty(3, 256, device="meta", dtype=torch.float16), w.to("meta"), sc.to("meta"),
                       CODE.to("meta"), 32, 24, 256, offset=mn.to("meta"), super_scales=units.to("meta"))
    assert meta.shape == (3, 24)


def test_bad_super_scales_name_the_argument():
    w, sc, mn, units = make_weight(24, 256)
    x = torch.randn(2, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"super_scales: expected float32 of shape \(24, 2\)"):
        matmul_4bit(x, w, sc, CODE, 32, 24, 256, offset=mn, super_scales=units[:-1])
    with pytest.raises(ValueError, match=r"super_scales: expected float32"):
        matmul_4bit(x, w, sc, CODE, 32, 24, 256, offset=mn, super_scales=units.half())
    with pytest.raises(ValueError, match=r"absmax: expected torch.uint8"):
        matmul_4bit(x, w, sc.float(), CODE, 32, 24, 256, offset=mn, super_scales=units)
    with pytest.raises(ValueError, match=r"offset: expected uint8 of shape \(192,\)"):
        matmul_4bit(x, w, sc, CODE, 32, 24, 256, offset=mn.float(), super_scales=units)
    with pytest.raises(ValueError, match="super_scales: need in_features"):
        matmul_4bit(torch.randn(1, 128), w[:64], sc[:4], CODE, 32, 1, 128, super_scales=units[:0])
    nest = (torch.rand(1), torch.linspace(-1, 1, 256), torch.tensor(0.0))
    with pytest.raises(ValueError, match="super_scales: K-quant super-block scales do not combine"):
        matmul_4bit(x, w, sc, CODE, 32, 24, 256, None, *nest, super_scales=units)
