"""Int8-block matmul (``W = scale[b] * q + offset[b]``, GGUF's 5/6/8-bit form): the op's reference against
dequantize + matmul, every kernel path against the reference (the interpreter on the CPU, the GPU otherwise), the
plan, the op's checks, autograd and meta."""

import pytest
import torch
import torch.nn.functional as F

from anygpu.ops import matmul_int8_block
from anygpu.ops.matmul_int8_block import dequantize_weight
from anygpu.testing import assert_accurate


def make_weight(n, k, blocksize, offset=True, device="cpu", low=-128, high=128):
    """Random codes over ``[low, high)``, scales like Q8_0 / Q6_K's and offsets like Q5_K's (up to the block's
    largest value either way, some blocks all one sign)."""
    g = torch.Generator().manual_seed(n * 7 + k + blocksize)
    codes = torch.randint(low, high, (n, k), dtype=torch.int8, generator=g)
    blocks = n * k // blocksize
    scale = torch.rand(blocks, generator=g) * 0.002 + 0.0002
    off = scale * 16 * (torch.rand(blocks, generator=g) - 0.5) if offset else None
    return codes.to(device), scale.to(device), None if off is None else off.to(device)


def check_close(y, x, codes, scale, bs, bias, offset, what):
    wd = dequantize_weight(codes, scale, bs, torch.float32, offset)
    oracle = F.linear(x.float(), wd, None if bias is None else bias.float())
    if x.dtype == torch.float32:
        # fp32: torch's own result is the oracle; the kernels sum scale * sum(q * x) (+ offset * sum(x)) per block,
        # another order than sum(w * x): a few fp32 ulps of the terms
        torch.testing.assert_close(y, oracle, rtol=1e-5, atol=1e-5, msg=what)
        return
    assert_accurate(y, F.linear(x, wd.to(x.dtype), bias), oracle, what=what)


def test_reference_is_dequantize_then_matmul():
    codes, scale, offset = make_weight(6, 64, 16)
    want = codes.float().reshape(-1, 16) * scale[:, None] + offset[:, None]
    w = dequantize_weight(codes, scale, 16, torch.float32, offset)
    assert torch.equal(w, want.reshape(6, 64))
    x = torch.randn(3, 64)
    torch.testing.assert_close(matmul_int8_block(x, codes, scale, 16, offset=offset), x @ want.reshape(6, 64).T)
    bias = torch.randn(6, dtype=torch.bfloat16)
    xb = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    y = matmul_int8_block(xb, codes, scale, 16, bias, offset)
    assert y.shape == (2, 5, 6) and torch.equal(y, F.linear(xb, w.bfloat16(), bias))


CASES = [  # m, n, k, blocksize, offset, bias
    (1, 40, 576, 32, True, True),  # K not a multiple of the GEMV's step (odd N too)
    (1, 33, 256, 16, False, False),
    (1, 24, 96, 16, True, False),  # fewer columns than one GEMV step
    (3, 24, 352, 32, True, True),  # the GEMM's one-block steps (K an odd number of blocks)
    (17, 70, 512, 16, True, False),  # the GEMM's dequantized tiles of several blocks
    (17, 48, 320, 32, False, True),  # the GEMM's step halved to 2 blocks
    (5, 40, 208, 16, False, True),  # Q6_K's blocks, an odd number of them
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,bs,offset,bias", CASES)
def test_kernel_paths_match_reference(kdevice, dtype, m, n, k, bs, offset, bias):
    from anygpu.kernels.launch import LaunchConfig, device_target, select
    from anygpu.kernels.matmul_int8_block import GEMM_CONFIGS, GEMV_CONFIGS, Plan, matmul_int8_block as kernel

    target = device_target(kdevice)  # None under the interpreter: the portable configs
    codes, scale, off = make_weight(n, k, bs, offset, kdevice)
    x = torch.randn(m, k, device=kdevice).to(dtype)
    b = torch.randn(n, device=kdevice).to(dtype) if bias else None
    gemv = select(GEMV_CONFIGS, target)[0]
    small_steps = LaunchConfig({**gemv.constexprs, "CHUNK": 64}, gemv.num_warps)
    plans = [Plan("gemv", gemv, s) for s in (1, 3)] + [Plan("gemv", small_steps, 2)] if m <= 3 else []
    plans += [Plan("gemm", cfg, s) for cfg in select(GEMM_CONFIGS, target) for s in (1, 2)] + [Plan("dequant")]
    first = select(GEMM_CONFIGS, target)[0]
    plans.append(Plan("gemm", LaunchConfig({**first.constexprs, "BLOCK_K": 32}, first.num_warps, first.num_stages), 3))
    for plan in plans:
        y = kernel(x, codes, scale, bs, b, off, plan_=plan)
        assert y.shape == (m, n) and y.dtype == dtype
        check_close(y, x, codes, scale, bs, b, off, f"{plan.path} {plan.config and plan.config.constexprs} "
                                                     f"split={plan.split_k} {dtype}")


@pytest.mark.parametrize("m", [1, 17])
def test_fp16_scales_are_the_widened_values(kdevice, m):
    """fp16 scale and offset (``gguf_8bit.narrow``'s form): every path computes with their fp32 values."""
    from anygpu.kernels.launch import device_target, select
    from anygpu.kernels.matmul_int8_block import GEMM_CONFIGS, GEMV_CONFIGS, Plan, matmul_int8_block as kernel

    codes, scale, off = make_weight(40, 512, 16, True, kdevice)
    scale, off = scale.half(), off.half()
    x = torch.randn(m, 512, device=kdevice).to(torch.bfloat16)
    target = device_target(kdevice)
    plans = [Plan("gemv", select(GEMV_CONFIGS, target)[0], 2)] if m == 1 else []
    plans += [Plan("gemm", select(GEMM_CONFIGS, target)[0], 2), Plan("dequant")]
    for plan in plans:
        y = kernel(x, codes, scale, 16, None, off, plan_=plan)
        check_close(y, x, codes, scale.float(), 16, None, off.float(), f"{plan.path} fp16 scales")
    assert torch.equal(dequantize_weight(codes, scale, 16, torch.float32, off),
                       dequantize_weight(codes, scale.float(), 16, torch.float32, off.float()))


def test_large_codes_and_activations_stay_accurate(kdevice):
    """Q8_0's full code range against activations in the hundreds (fp16): the GEMV sums in fp32, the GEMM's
    decoded values are the weight's own."""
    from anygpu.kernels.launch import device_target, select
    from anygpu.kernels.matmul_int8_block import GEMM_CONFIGS, GEMV_CONFIGS, Plan, matmul_int8_block as kernel

    codes = torch.full((32, 256), 127, dtype=torch.int8, device=kdevice)
    codes[::2] = -128
    scale = torch.full((32 * 256 // 32,), 0.001, device=kdevice)  # outputs near 10^4, inside fp16's range
    x = torch.full((1, 256), 300.0, device=kdevice, dtype=torch.float16)
    target = device_target(kdevice)
    for plan in (Plan("gemv", select(GEMV_CONFIGS, target)[0], 1), Plan("gemm", select(GEMM_CONFIGS, target)[0], 1)):
        y = kernel(x, codes, scale, 32, plan_=plan)
        check_close(y, x, codes, scale, 32, None, None, plan.path)


def test_dequantize_kernel_is_the_reference_bit_for_bit(kdevice):
    """The same fp32 values (FP contraction off), rounded once; the interpreter rounds fp32 -> bf16 by truncation
    (a GPU to nearest even), so there the reference's fp32 values are truncated."""
    from anygpu.kernels.matmul_int8_block import dequantize_weight as kernel_dequantize
    from anygpu.testing import interpreter_active

    for bs, offset in ((16, True), (32, False)):
        codes, scale, off = make_weight(70, 96, bs, offset, kdevice)
        exact = dequantize_weight(codes, scale, bs, torch.float32, off)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = exact.to(dtype)
            if dtype == torch.bfloat16 and interpreter_active():
                want = (exact.view(torch.int32) & -65536).view(torch.float32).to(dtype)
            assert torch.equal(kernel_dequantize(codes, scale, bs, dtype, off), want), (bs, dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m", [1, 3, 17, 80])
def test_op_on_every_path(device, m):
    """The op as callers use it (the plan's choice)."""
    codes, scale, offset = make_weight(96, 256, 16, True, device)
    x = torch.randn(m, 256, device=device, dtype=torch.bfloat16)
    bias = torch.randn(96, device=device, dtype=torch.bfloat16)
    check_close(matmul_int8_block(x, codes, scale, 16, bias, offset), x, codes, scale, 16, bias, offset, f"m={m}")


def test_plan_picks_paths_by_rows():
    from anygpu.kernels.matmul_int8_block import plan

    cpu = torch.device("cpu")
    assert plan(1, 4096, 4096, 32, torch.bfloat16, cpu).path == "gemv"
    assert plan(1, 64, 8192, 32, torch.bfloat16, cpu).split_k > 1  # few rows: K split
    assert plan(1, 65536, 8192, 32, torch.bfloat16, cpu).split_k == 1  # rows enough to fill the GPU
    assert plan(16, 4096, 4096, 16, torch.float16, cpu).path == "gemm"
    assert plan(16, 4096, 4096, 16, torch.float32, cpu).path == "dequant"
    assert plan(65, 4096, 4096, 32, torch.bfloat16, cpu).path == "dequant"


def test_gemm_step_is_the_longest_that_divides_k():
    from anygpu.kernels.launch import LaunchConfig
    from anygpu.kernels.matmul_int8_block import gemm_block_k, gemm_split

    cfg = LaunchConfig({"BLOCK_K": 128, "SPLIT_K": 4})
    assert [gemm_block_k(cfg, k, 32) for k in (4096, 4160, 4128, 96)] == [128, 64, 32, 32]
    assert gemm_block_k(cfg, 208, 16) == 16 and gemm_block_k(cfg, 224, 16) == 32
    assert gemm_split(cfg, 4096, 32) == 4 and gemm_split(cfg, 256, 32) == 2 and gemm_split(cfg, 96, 32) == 2


def test_opcheck_gradient_and_meta():
    codes, scale, offset = make_weight(24, 128, 32)
    x = torch.randn(5, 128, dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(matmul_int8_block.overload, (x, codes, scale, 32, None, offset))
    x32 = torch.randn(3, 128, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    y = matmul_int8_block(x32, codes, scale, 32, bias, offset)
    g = torch.randn_like(y)
    y.backward(g)
    wd = dequantize_weight(codes, scale, 32, torch.float32, offset)
    torch.testing.assert_close(x32.grad, g @ wd)
    torch.testing.assert_close(bias.grad, g.sum(0))
    meta = matmul_int8_block(torch.empty(3, 128, device="meta", dtype=torch.float16), codes.to("meta"),
                             scale.to("meta"), 32, offset=offset.to("meta"))
    assert meta.shape == (3, 24)


def test_bad_arguments_name_them():
    codes, scale, offset = make_weight(24, 128, 32)
    x = torch.randn(2, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="x: expected dtype float16, bfloat16 or float32"):
        matmul_int8_block(x.int(), codes, scale, 32)
    with pytest.raises(ValueError, match=r"x: expected a last dimension of in_features=128"):
        matmul_int8_block(x[:, :64], codes, scale, 32)
    with pytest.raises(ValueError, match="codes: expected an int8"):
        matmul_int8_block(x, codes.to(torch.uint8), scale, 32)
    with pytest.raises(ValueError, match="codes: expected contiguous"):
        matmul_int8_block(x, codes.T.contiguous().T, scale, 32)
    with pytest.raises(ValueError, match=r"blocksize: expected one of \(16, 32\), got 64"):
        matmul_int8_block(x, codes, scale[:48], 64)
    with pytest.raises(ValueError, match=r"scale: expected float32 or float16 of shape \(96,\)"):
        matmul_int8_block(x, codes, scale[:-1], 32)
    with pytest.raises(ValueError, match=r"scale: expected float32 or float16"):
        matmul_int8_block(x, codes, scale.bfloat16(), 32)
    with pytest.raises(ValueError, match=r"offset: expected torch.float32 \(scale's dtype\) of shape \(96,\)"):
        matmul_int8_block(x, codes, scale, 32, offset=offset[:-1])
    with pytest.raises(ValueError, match=r"offset: expected torch.float16 \(scale's dtype\)"):
        matmul_int8_block(x, codes, scale.half(), 32, offset=offset)
    with pytest.raises(ValueError, match=r"bias: expected torch.float16 of shape \(24,\)"):
        matmul_int8_block(x, codes, scale, 32, torch.randn(24))
    c2, s2, _ = make_weight(2, 48, 16, False)
    with pytest.raises(ValueError, match=r"codes: expected in_features \(48\) to be a multiple of blocksize \(32\)"):
        matmul_int8_block(torch.randn(1, 48), c2, s2[:3], 32)


def test_strided_and_batched_x(kdevice):
    """x a column slice of a wider tensor (rows further apart than K) and with leading dimensions: the kernels read
    rows at x's own stride."""
    from anygpu.kernels.launch import device_target, select
    from anygpu.kernels.matmul_int8_block import GEMM_CONFIGS, GEMV_CONFIGS, Plan, matmul_int8_block as kernel

    codes, scale, off = make_weight(40, 128, 32, True, kdevice)
    wide = torch.randn(2, 9, 256, device=kdevice, dtype=torch.float16)
    x = wide[..., 64:192]
    target = device_target(kdevice)
    for plan in (Plan("gemv", select(GEMV_CONFIGS, target)[0], 2), Plan("gemm", select(GEMM_CONFIGS, target)[0], 1),
                 Plan("dequant")):
        y = kernel(x, codes, scale, 32, None, off, plan_=plan)
        assert y.shape == (2, 9, 40)
        check_close(y.reshape(18, 40), x.reshape(18, 128), codes, scale, 32, None, off, plan.path)
