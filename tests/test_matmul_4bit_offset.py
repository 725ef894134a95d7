"""4-bit matmul with a per-block offset (``code[q] * absmax[b] + offset[b]``, GGUF's Q4_1 / Q4_K form): every
kernel path against the op's reference, the MMA path's fallback, the op's checks, autograd and meta."""

import pytest
import torch
import torch.nn.functional as F

from anygpu.ops import matmul_4bit
from anygpu.ops.matmul_4bit import dequantize_weight
from anygpu.testing import assert_accurate

# GGUF's Q4_0 / Q4_1 / Q4_K codes as anygpu/quant/gguf_4bit.py centres and scales them ((q - 8) / 8)
CODE = (torch.arange(16, dtype=torch.float32) - 8) / 8


def make_weight(n, k, blocksize, device="cpu"):
    """Random codes, scales and offsets like a Q4_1 / Q4_K weight's in gguf_4bit's form: offsets up to half the
    block's scale either way (a block's minimum a little off -8 d), some blocks all one sign."""
    g = torch.Generator().manual_seed(n * 7 + k + blocksize)
    w = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=g)
    blocks = n * k // blocksize
    absmax = torch.rand(blocks, generator=g) * 0.08 + 0.008
    offset = absmax * (torch.rand(blocks, generator=g) - 0.5)
    return w.to(device), absmax.to(device), CODE.to(device), offset.to(device)


def check_close(y, x, w, absmax, code, bs, n, k, bias, offset, what):
    wd = dequantize_weight(w, absmax, code, bs, n, k, torch.float32, offset=offset)
    oracle = F.linear(x.float(), wd, None if bias is None else bias.float())
    if x.dtype == torch.float32:
        # fp32: torch's own result is the oracle, so the 2x-its-error rule would ask for bit equality; the kernels
        # sum scale * sum(code * x) + offset * sum(x) in another order than sum(w * x): a few fp32 ulps of the
        # terms, which cancel partly, so up to ~10 ulps of the output.
        torch.testing.assert_close(y, oracle, rtol=1e-5, atol=1e-5, msg=what)
        return
    torch_same = F.linear(x, wd.to(x.dtype), bias)
    assert_accurate(y, torch_same, oracle, what=what)


CASES = [  # m, n, k, blocksize, bias
    (1, 40, 576, 32, True),  # K not a multiple of the GEMV's step
    (1, 33, 256, 64, False),
    (3, 24, 352, 32, True),
    (17, 70, 512, 32, False),  # the GEMM's folded steps of several blocks (K a multiple of 256)
    (17, 48, 320, 64, True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,bs,bias", CASES)
def test_kernel_paths_with_offset_match_reference(kdevice, dtype, m, n, k, bs, bias):
    from anygpu.kernels.launch import LaunchConfig, device_target
    from anygpu.kernels.matmul_4bit import GEMM_CONFIGS, GEMV_CONFIGS, MMA_CONFIGS, Plan, matmul_4bit as kernel, select

    target = device_target(kdevice)  # None under the interpreter: the portable configs
    w, absmax, code, offset = make_weight(n, k, bs, kdevice)
    x = torch.randn(m, k, device=kdevice).to(dtype)
    b = torch.randn(n, device=kdevice).to(dtype) if bias else None
    gemv = select(GEMV_CONFIGS, target)[0]
    small_steps = LaunchConfig({**gemv.constexprs, "CHUNK": 32, "PREFETCH": False}, gemv.num_warps)
    plans = [Plan("gemv", gemv, s) for s in (1, 3)] + [Plan("gemv", small_steps, 2)] if m <= 3 else []
    # The MMA path has no offset term: the launcher hands such a call to the GEMM.
    plans += [Plan("mma", select(MMA_CONFIGS, target)[0], 2)]
    plans += [Plan("gemm", cfg, s) for cfg in select(GEMM_CONFIGS, target) for s in (1, 2)] + [Plan("dequant")]
    first = select(GEMM_CONFIGS, target)[0]
    plans.append(Plan("gemm", LaunchConfig({**first.constexprs, "BLOCK_K": 256, "FOLD_SCALE": True},
                                           first.num_warps, first.num_stages), 2))
    for plan in plans:
        y = kernel(x, w, absmax, code, bs, n, k, b, offset=offset, plan_=plan)
        assert y.shape == (m, n) and y.dtype == dtype
        check_close(y, x, w, absmax, code, bs, n, k, b, offset, f"{plan.path} split={plan.split_k} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,bs,bias", [CASES[0], CASES[3]])
def test_fp16_scales_equal_their_fp32_values_on_every_path(kdevice, dtype, m, n, k, bs, bias):
    """fp16 absmax and offset (GGUF's, where they fit: quant/gguf_4bit.py ``narrow``) are widened exactly where the
    kernels read them: each path gives what it gives for the same values held in fp32, bit for bit."""
    from anygpu.kernels.launch import device_target
    from anygpu.kernels.matmul_4bit import GEMM_CONFIGS, GEMV_CONFIGS, Plan, matmul_4bit as kernel, select

    target = device_target(kdevice)
    w, absmax, code, offset = make_weight(n, k, bs, kdevice)
    absmax16, offset16 = absmax.half(), offset.half()
    x = torch.randn(m, k, device=kdevice).to(dtype)
    b = torch.randn(n, device=kdevice).to(dtype) if bias else None
    plans = [Plan("gemv", select(GEMV_CONFIGS, target)[0], 2)] if m == 1 else []
    plans += [Plan("gemm", select(GEMM_CONFIGS, target)[0], 2), Plan("dequant")]
    for plan in plans:
        y = kernel(x, w, absmax16, code, bs, n, k, b, offset=offset16, plan_=plan)
        want = kernel(x, w, absmax16.float(), code, bs, n, k, b, offset=offset16.float(), plan_=plan)
        assert torch.equal(y, want), plan.path
    y = matmul_4bit(x, w, absmax16, code, bs, n, k, b, offset=offset16)  # the op, and its reference on the CPU
    check_close(y, x, w, absmax16.float(), code, bs, n, k, b, offset16.float(), "op")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m", [1, 3, 17, 80])
def test_op_with_offset_on_every_path(device, m):
    """The op as callers use it (the plan's choice): on a GPU 3 rows would be the MMA path's, which hands over."""
    w, absmax, code, offset = make_weight(96, 256, 32, device)
    x = torch.randn(m, 256, device=device, dtype=torch.bfloat16)
    bias = torch.randn(96, device=device, dtype=torch.bfloat16)
    y = matmul_4bit(x, w, absmax, code, 32, 96, 256, bias, offset=offset)
    check_close(y, x, w, absmax, code, 32, 96, 256, bias, offset, f"m={m}")


def test_reference_adds_the_offset_per_block():
    w, absmax, code, offset = make_weight(4, 64, 32)
    codes = torch.stack([w >> 4, w & 15], -1).reshape(4, 64).long()
    want = code[codes] * absmax.repeat_interleave(32).reshape(4, 64) + offset.repeat_interleave(32).reshape(4, 64)
    assert torch.equal(dequantize_weight(w, absmax, code, 32, 4, 64, torch.float32, offset=offset), want)
    x = torch.randn(2, 64)
    torch.testing.assert_close(matmul_4bit(x, w, absmax, code, 32, 4, 64, offset=offset), x @ want.T)


def test_opcheck_gradient_and_meta_with_offset():
    w, absmax, code, offset = make_weight(24, 128, 32)
    x = torch.randn(5, 128, dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(matmul_4bit.overload, (x, w, absmax, code, 32, 24, 128, None, None, None, None, offset))
    x32 = torch.randn(3, 128, requires_grad=True)
    y = matmul_4bit(x32, w, absmax, code, 32, 24, 128, offset=offset)
    g = torch.randn_like(y)
    y.backward(g)
    wd = dequantize_weight(w, absmax, code, 32, 24, 128, torch.float32, offset=offset)
    torch.testing.assert_close(x32.grad, g @ wd)
    meta = matmul_4bit(torch.empty(3, 128, device="meta", dtype=torch.float16), w.to("meta"), absmax.to("meta"),
                       code.to("meta"), 32, 24, 128, offset=offset.to("meta"))
    assert meta.shape == (3, 24)


def test_bad_offset_names_the_argument():
    w, absmax, code, offset = make_weight(24, 128, 32)
    x = torch.randn(2, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"offset: expected float32 \(absmax's dtype\) of shape \(96,\)"):
        matmul_4bit(x, w, absmax, code, 32, 24, 128, offset=offset[:-1])
    with pytest.raises(ValueError, match=r"offset: expected float32 \(absmax's dtype\)"):
        matmul_4bit(x, w, absmax, code, 32, 24, 128, offset=offset.half())
    with pytest.raises(ValueError, match=r"offset: expected float16 \(absmax's dtype\)"):
        matmul_4bit(x, w, absmax.half(), code, 32, 24, 128, offset=offset)
    with pytest.raises(ValueError, match=r"absmax: expected torch.float32 or torch.float16"):
        matmul_4bit(x, w, absmax.bfloat16(), code, 32, 24, 128, offset=offset.bfloat16())
    nest = (torch.rand(1), torch.linspace(-1, 1, 256), torch.tensor(0.0))
    with pytest.raises(ValueError, match="offset: a per-block offset does not combine with double quantization"):
        matmul_4bit(x, w, absmax.to(torch.uint8), code, 32, 24, 128, None, *nest, offset=offset)
    w2, absmax2, _, _ = make_weight(2, 48, 32)
    with pytest.raises(ValueError, match="offset: needs in_features"):
        matmul_4bit(torch.randn(1, 48), w2, torch.rand(3), code, 32, 2, 48, offset=torch.rand(3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_offset", [True, False])
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_linear_table_decoder_agrees_with_the_table_decoder(monkeypatch, dtype, with_offset, m):
    """On NVIDIA the GEMV and GEMM decode this table's codes by arithmetic (``_decode_4bit_linear.linear_code``); the
    table decoder (``linear_code`` turned off) and the reference must agree with it at a model's shapes."""
    import anygpu.kernels.matmul_4bit as K

    import anygpu.kernels._decode_4bit_linear as D

    monkeypatch.setattr(D, "LINEAR_DECODE", True)
    n, k = 1024, 4096
    w, absmax, code, offset = make_weight(n, k, 32, "cuda")
    offset = offset if with_offset else None
    assert K.linear_code(code)
    x = torch.randn(m, k, device="cuda").to(dtype)
    fast = matmul_4bit(x, w, absmax, code, 32, n, k, offset=offset)
    check_close(fast, x, w, absmax, code, 32, n, k, None, offset, f"linear m={m}")
    monkeypatch.setattr(K, "linear_code", lambda code: False)
    table = matmul_4bit(x, w, absmax, code, 32, n, k, offset=offset)
    check_close(table, x, w, absmax, code, 32, n, k, None, offset, f"table m={m}")
    torch.testing.assert_close(fast.float(), table.float(), rtol=2e-2, atol=2e-2 * table.float().abs().max().item())
