"""4-bit matmul: the Triton paths (GEMV, fused GEMM) against the dequantize-then-linear reference, the
op's checks, autograd, and the plan that picks a path."""

import pytest
import torch
import torch.nn.functional as F

from anygpu.ops import matmul_4bit
from anygpu.ops.matmul_4bit import dequantize_weight
from anygpu.testing import assert_accurate

NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def make_weight(n, k, blocksize, nested, device="cpu"):
    """Random packed codes and scales in bitsandbytes' layout (the kernels do not care how they arose)."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randint(0, 256, ((n * k + 1) // 2,), dtype=torch.uint8, generator=g)
    blocks = -(-n * k // blocksize)
    if nested:
        absmax = torch.randint(0, 256, (blocks,), dtype=torch.uint8, generator=g)
        nest = (torch.rand(-(-blocks // 256), generator=g) * 0.1, torch.linspace(-1, 1, 256), torch.tensor(0.05))
    else:
        absmax, nest = torch.rand(blocks, generator=g) * 0.1 + 0.01, (None, None, None)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(w), to(absmax), NF4.to(device), tuple(to(t) for t in nest)


def check_close(y, x, w, absmax, code, bs, n, k, bias, nest, what):
    wd = dequantize_weight(w, absmax, code, bs, n, k, torch.float32, *nest)
    oracle = F.linear(x.float(), wd, None if bias is None else bias.float())
    torch_same = F.linear(x, wd.to(x.dtype), bias)
    assert_accurate(y, torch_same, oracle, what=what)


CASES = [  # m, n, k, blocksize, nested, bias
    (1, 40, 576, 64, False, True),  # SmolLM2's K
    (1, 33, 256, 32, True, False),
    (1, 8, 4096, 4096, False, False),
    (3, 24, 384, 128, True, True),
    (8, 50, 320, 64, True, True),  # the MMA path's 8 rows; rows past a warp's 16 and a program's 64
    (16, 64, 128, 64, False, True),
    (17, 70, 256, 64, True, False),
    (40, 96, 576, 64, True, True),  # partial row and column tiles, odd K / 64
    (70, 48, 512, 256, False, False),  # a step of the block is several tiles of K
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,bs,nested,bias", CASES)
def test_kernel_paths_match_reference(kdevice, dtype, m, n, k, bs, nested, bias):
    from anygpu.kernels.launch import LaunchConfig, device_target
    from anygpu.kernels.matmul_4bit import GEMM_CONFIGS, GEMV_CONFIGS, MMA_CONFIGS, Plan, matmul_4bit as kernel, select

    target = device_target(kdevice)  # None under the interpreter: the portable configs
    w, absmax, code, nest = make_weight(n, k, bs, nested, kdevice)
    x = torch.randn(m, k, device=kdevice).to(dtype)
    b = torch.randn(n, device=kdevice).to(dtype) if bias else None
    gemv = select(GEMV_CONFIGS, target)[0]
    # Also a step of one block or less, without prefetch, whatever the table's choice.
    small_steps = LaunchConfig({**gemv.constexprs, "CHUNK": 32, "PREFETCH": False}, gemv.num_warps)
    # every GEMV entry of the table (NVIDIA's shape-specific ones too), whatever shape they were chosen for
    plans = ([Plan("gemv", cfg, s) for cfg in select(GEMV_CONFIGS, target) for s in (1, 3)]
             + [Plan("gemv", small_steps, 2)] if m <= 3 else [])
    if m <= 8 and bs % 64 == 0 and k % 64 == 0:
        plans += [Plan("mma", select(MMA_CONFIGS, target)[0], s) for s in (1, 3)]
    plans += [Plan("gemm", cfg, s) for cfg in select(GEMM_CONFIGS, target) for s in (1, 2)] + [Plan("dequant")]
    # Steps of several 4-bit blocks with the scales folded into the decoded values (the NVIDIA tables' choice),
    # wherever K allows (else the launcher keeps one block per step).
    first = select(GEMM_CONFIGS, target)[0]
    plans.append(Plan("gemm", LaunchConfig({**first.constexprs, "BLOCK_K": 256, "FOLD_SCALE": True},
                                           first.num_warps, first.num_stages), 2))
    for plan in plans:
        y = kernel(x, w, absmax, code, bs, n, k, b, *nest, plan_=plan)
        assert y.shape == (m, n) and y.dtype == dtype
        check_close(y, x, w, absmax, code, bs, n, k, b, nest, f"{plan.path} split={plan.split_k} {dtype}")


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vendor_gemm_path_dequantizes_in_one_kernel(kdevice, nested, dtype):
    """The long-prompt path's weight (double quantization decoded inside the dequantize kernel) has the bits of
    the op's reference dequantization: absmax codes through the nested table, its block of 256 scales, plus
    the offset, then code * absmax in fp32, rounded once.  Blocks past the first 256 check the nested index."""
    from anygpu.kernels.matmul_4bit import dequantize_weight as kernel_dequantize

    n, k = 72, 512  # 576 blocks of 64: three nested blocks, the last partial
    w, absmax, code, nest = make_weight(n, k, 64, nested, kdevice)
    got = kernel_dequantize(w, absmax, code, 64, n, k, dtype, *nest)
    want = dequantize_weight(w.cpu(), absmax.cpu(), code.cpu(), 64, n, k, dtype, *(t if t is None else t.cpu()
                                                                                   for t in nest))
    if kdevice.type == "cpu":  # the interpreter: numpy's fp32 arithmetic, step for step
        assert torch.equal(got, want)
    else:  # a GPU may fuse the nested multiply-add into one FMA: one fp32 ulp of a scale at most
        torch.testing.assert_close(got.cpu(), want, rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -22, atol=0)


def test_leading_dims_and_empty_batch(kdevice):
    from anygpu.kernels.matmul_4bit import matmul_4bit as kernel

    w, absmax, code, nest = make_weight(16, 128, 64, False, kdevice)
    x = torch.randn(2, 1, 128, device=kdevice, dtype=torch.float16)
    y = kernel(x, w, absmax, code, 64, 16, 128)
    assert y.shape == (2, 1, 16)
    check_close(y.reshape(2, 16), x.reshape(2, 128), w, absmax, code, 64, 16, 128, None, nest, "3-D x")
    assert kernel(x[:0], w, absmax, code, 64, 16, 128).shape == (0, 1, 16)


def test_plan_picks_paths_and_takes_an_override():
    from anygpu.kernels import matmul_4bit as K
    from anygpu.kernels.launch import set_plan_hook

    cpu = torch.device("cpu")
    assert K.plan(1, 8192, 8192, 64, torch.float16, cpu).path == "gemv"
    assert K.plan(1, 8192, 8192, 64, torch.float16, cpu).split_k == 8
    assert K.plan(1, 64, 2048, 64, torch.float16, cpu).split_k == 4  # 16 steps of 128: split while each keeps 4
    assert K.plan(1, 64, 576, 64, torch.float16, cpu).split_k == 1
    assert K.plan(16, 8192, 8192, 64, torch.float16, cpu).path == "gemm"
    assert K.plan(64, 8192, 8192, 64, torch.float16, cpu).path == "gemm"
    assert K.plan(65, 8192, 8192, 64, torch.float16, cpu).path == "dequant"
    assert K.plan(4096, 8192, 8192, 64, torch.float16, cpu).path == "dequant"
    assert K.plan(1, 10, 100, 64, torch.float16, cpu).path == "dequant"  # blocks straddle rows
    try:
        set_plan_hook("matmul_4bit", lambda m, n, k, bs, dtype, device: K.Plan("dequant") if m == 1 else None)
        assert K.plan(1, 8192, 8192, 64, torch.float16, cpu).path == "dequant"
        assert K.plan(16, 8192, 8192, 64, torch.float16, cpu).path == "gemm"
    finally:
        set_plan_hook("matmul_4bit", None)


def test_nvidia_plan_takes_the_tensor_cores_for_two_to_eight_rows(monkeypatch):
    """NVIDIA (faked sm_90): 1 row the GEMV (its config by the weight's shape), 2-8 rows the MMA path where K and
    the block size allow it, then the GEMM; AMD (faked gfx942) never the MMA path (it is NVIDIA PTX)."""
    from anygpu.backend.targets import TARGETS
    from anygpu.kernels import matmul_4bit as K

    cuda, h = torch.device("cuda", 0), torch.float16
    monkeypatch.setattr(K, "device_target", lambda device: TARGETS["sm_90"])
    assert [K.plan(m, 8192, 8192, 64, h, cuda).path for m in (1, 2, 8, 9, 64)] == ["gemv", "mma", "mma", "gemm", "gemm"]
    assert K.plan(4, 8192, 8192, 64, h, cuda).split_k == 8  # 128 steps of 64 columns
    assert K.plan(4, 64, 576, 64, h, cuda).split_k == 2  # 9 steps: split while each keeps 4
    assert K.plan(4, 8192, 8192, 32, h, cuda).path == "gemm"  # a step of 64 columns would span two blocks
    assert K.plan(4, 64, 96, 32, h, cuda).path == "gemm"
    assert K.plan(4, 8192, 8192, 64, torch.float32, cuda).path == "gemm"
    # One row: the shape-specific GEMV entries where their bounds hold (gate/up-like, down-like: GGUF's blocks of 32
    # and bitsandbytes' of 64 apart), else the first.
    first, deep_gguf, gguf, wide, deep, narrow = K.select(K.GEMV_CONFIGS, TARGETS["sm_90"])
    assert K.plan(1, 28672, 4096, 64, h, cuda) == K.Plan("gemv", wide, 2)
    assert K.plan(1, 4096, 14336, 64, h, cuda) == K.Plan("gemv", deep, 8)
    assert K.plan(1, 4096, 14336, 32, h, cuda) == K.Plan("gemv", deep_gguf, 8)
    assert deep_gguf.constexprs["BLOCK_N"] == 16 and deep.constexprs["BLOCK_N"] == 32
    assert [K.plan(1, n, 4096, 32, h, cuda).config for n in (28672, 6144, 4096)] == [gguf] * 3
    assert K.plan(1, 1024, 4096, 32, h, cuda).config is narrow
    assert K.plan(1, 1024, 14336, 64, h, cuda).config is deep  # the first entry whose bounds hold
    assert K.plan(1, 1024, 8192, 64, h, cuda) == K.Plan("gemv", narrow, 8)
    assert [K.plan(1, n, k, 64, h, cuda) for n, k in ((8192, 8192), (28672, 8192), (6144, 4096), (8192, 14336))] \
        == [K.Plan("gemv", first, 4)] * 4
    monkeypatch.setattr(K, "device_target", lambda device: TARGETS["gfx942"])
    assert K.plan(4, 8192, 8192, 64, h, cuda).path == "gemm"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("nested", [False, True])
def test_opcheck(device, nested):
    w, absmax, code, nest = make_weight(24, 128, 64, nested, device)
    x = torch.randn(5, 128, device=device, dtype=torch.float16, requires_grad=True)
    bias = torch.randn(24, device=device, dtype=torch.float16)
    torch.library.opcheck(matmul_4bit.overload, (x, w, absmax, code, 64, 24, 128, bias, *nest))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_op_on_every_path(device, m):
    w, absmax, code, nest = make_weight(96, 256, 64, True, device)
    x = torch.randn(m, 256, device=device, dtype=torch.bfloat16)
    bias = torch.randn(96, device=device, dtype=torch.bfloat16)
    check_close(matmul_4bit(x, w, absmax, code, 64, 96, 256, bias, *nest), x, w, absmax, code, 64, 96, 256, bias,
                nest, f"m={m}")


def test_gradient_flows_to_the_input_through_the_frozen_weight():
    w, absmax, code, nest = make_weight(32, 64, 32, True)
    x = torch.randn(4, 64, dtype=torch.float32, requires_grad=True)
    bias = torch.randn(32, requires_grad=True)
    y = matmul_4bit(x, w, absmax, code, 32, 32, 64, bias, *nest)
    g = torch.randn_like(y)
    y.backward(g)
    wd = dequantize_weight(w, absmax, code, 32, 32, 64, torch.float32, *nest)
    x2, b2 = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    F.linear(x2, wd, b2).backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(bias.grad, b2.grad)


def test_meta_and_compile():
    w, absmax, code, nest = make_weight(24, 128, 64, False)
    y = matmul_4bit(torch.empty(3, 128, device="meta", dtype=torch.float16), w.to("meta"), absmax.to("meta"),
                    code.to("meta"), 64, 24, 128)
    assert y.shape == (3, 24)
    f = torch.compile(lambda t: matmul_4bit(t, w, absmax, code, 64, 24, 128) + 1, fullgraph=True, backend="eager")
    x = torch.randn(3, 128)
    torch.testing.assert_close(f(x), matmul_4bit(x, w, absmax, code, 64, 24, 128) + 1)


def test_bad_arguments_name_the_argument():
    w, absmax, code, nest = make_weight(24, 128, 64, False)
    x = torch.randn(2, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x: expected a last dimension of in_features=128"):
        matmul_4bit(torch.randn(2, 100, dtype=torch.float16), w, absmax, code, 64, 24, 128)
    with pytest.raises(ValueError, match="x: expected dtype float16, bfloat16 or float32"):
        matmul_4bit(x.int(), w, absmax, code, 64, 24, 128)
    with pytest.raises(ValueError, match="blocksize: expected one of"):
        matmul_4bit(x, w, absmax, code, 48, 24, 128)
    with pytest.raises(ValueError, match="weight: expected 1536 bytes"):
        matmul_4bit(x, w[:-1], absmax, code, 64, 24, 128)
    with pytest.raises(ValueError, match=r"absmax: expected torch.float32 or torch.float16 of shape \(48,\)"):
        matmul_4bit(x, w, absmax[:-1], code, 64, 24, 128)
    with pytest.raises(ValueError, match="code: expected the float32 16-entry table"):
        matmul_4bit(x, w, absmax, code[:8], 64, 24, 128)
    with pytest.raises(ValueError, match="nested_absmax, nested_code, nested_offset: expected all three"):
        matmul_4bit(x, w, absmax, code, 64, 24, 128, None, torch.rand(1))
    with pytest.raises(ValueError, match=r"bias: expected torch.float16 of shape \(24,\)"):
        matmul_4bit(x, w, absmax, code, 64, 24, 128, torch.randn(24))


def test_mma_path_fragments_cover_each_column_once():
    """The tensor-core path's lane plan, replayed on the CPU from its PTX text: each lane's byte permutes give
    mma.sync.m16n8k16's A fragment (PTX ISA layout: a0..a7 = rows g, g, g+8, g+8, g, g, g+8, g+8 at slots 2q,
    2q+1, 2q, 2q+1, 2q+8, 2q+9, 2q+8, 2q+9), x gives the B fragment, and the four MMAs of a step add up to
    W x^T over the step's 64 columns."""
    import re

    from anygpu.kernels.gemv_mma_4bit import _mma_steps

    ptx = _mma_steps(bf16=True)
    permutes = re.findall(r"prmt\.b32 w, \$(\d), \$(\d), (0x[0-9A-F]+);", ptx)
    b_regs = re.findall(r"\{\$(\d+), \$(\d+)\}, \{\$0", ptx)
    assert len(permutes) == 4 and len(b_regs) == 4
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 64), generator=g)  # one warp's 16 rows x one step's 64 columns
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]  # bitsandbytes: the even column in the high nibble
    x = torch.randint(-4, 5, (8, 64), generator=g)  # 8 rows of x (the B fragment's columns)
    c = torch.zeros(16, 8, dtype=torch.long)
    for s in range(4):
        a = torch.zeros(16, 16, dtype=torch.long)  # rows x the MMA's 16 slots
        b = torch.zeros(16, 8, dtype=torch.long)
        for lane in range(32):
            gg, q = lane // 4, lane % 4
            regs = {4: packed[gg, 8 * q: 8 * q + 4], 5: packed[gg, 8 * q + 4: 8 * q + 8],
                    6: packed[gg + 8, 8 * q: 8 * q + 4], 7: packed[gg + 8, 8 * q + 4: 8 * q + 8]}
            first, second, sel = permutes[s]
            pool = torch.cat([regs[int(first)], regs[int(second)]])
            word = [int(pool[(int(sel, 16) >> (4 * i)) & 7]) for i in range(4)]
            elements = [v for byte in word for v in (byte >> 4, byte & 15)]  # the decoder's element order
            rows = (gg, gg, gg + 8, gg + 8, gg, gg, gg + 8, gg + 8)
            slots = (2 * q, 2 * q + 1, 2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9, 2 * q + 8, 2 * q + 9)
            for r, k, v in zip(rows, slots, elements):
                a[r, k] = v
            pairs = x[gg, 16 * q: 16 * q + 16].reshape(8, 2)  # the lane's x words $8..$15
            lo, hi = (int(r) - 8 for r in b_regs[s])
            b[2 * q: 2 * q + 2, gg], b[2 * q + 8: 2 * q + 10, gg] = pairs[lo], pairs[hi]
        c += a @ b
    assert torch.equal(c, codes @ x.T)
