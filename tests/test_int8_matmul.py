"""The LLM.int8() matmul kernels (anygpu/kernels/int8_matmul.py, int8_matmul_tma.py, int8_quantize.py,
int8_outlier_epilogue.py) against the op's PyTorch reference (anygpu/ops/int8_matmul.py, which
tests/test_int8.py holds to bitsandbytes): in Triton's interpreter on the CPU, or on a GPU.

The contract: without outlier columns the output is bit-identical to the reference (exact int32
accumulation, the reference's fp32 operations in its order); with them, the outlier columns' fp32 sum
may be in another order than the reference GEMM's, so each output is within one unit in the last place
of x's dtype (at its magnitude, plus fp32 rounding of the outlier products), and almost all are identical.
"""

import pytest
import torch

from anygpu.ops import int8_matmul as int8_matmul_op
from anygpu.ops.int8_matmul import quantize_rows, reference
from anygpu.testing import poison_, same_bits

pytest.importorskip("triton")

from anygpu.kernels import int8_matmul as K  # noqa: E402
from anygpu.kernels import int8_outlier_epilogue as E  # noqa: E402
from anygpu.kernels import int8_quantize as Q  # noqa: E402
from anygpu.kernels.int8_quantize import fp16_threshold  # noqa: E402
from anygpu.kernels.int8_matmul import PATHS, Plan, plan, plan_for  # noqa: E402
from anygpu.kernels.int8_matmul_tma import GEMM_TMA_CONFIGS  # noqa: E402
from anygpu.kernels.int8_outlier_epilogue import OUTLIER_EPILOGUE_SPEC  # noqa: E402
from anygpu.kernels.launch import LaunchConfig, select, set_plan_hook  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
N, KDIM = 37, 300  # N odd, K a multiple of no block size


def weight(n=N, k=KDIM):
    w = (torch.randn(n, k) / k**0.5).half()
    CB, SCB, _ = quantize_rows(w, 0.0)
    return CB, SCB


def activations(m, k=KDIM, dtype=torch.float16, outliers=True):
    x = torch.randn(m, k)
    if outliers:  # whole columns with a few large values (LLM-style), one near the end of K
        x[::2, 3] = 9.0
        x[1::3, k - 2] = -7.5
        x[0, 130] = 6.0  # exactly the threshold: an outlier (>=)
        x[-1, 131] = 5.99  # just under it
    return x.to(dtype)


def path_plan(path, m, n, k, device):
    try:
        return plan_for(path, m, n, k, torch.device(device))
    except ValueError as e:  # a path that does not run on this device
        pytest.skip(str(e))


def run_kernel(x, CB, SCB, threshold, bias, path, device):
    x, CB, SCB = x.to(device), CB.to(device), SCB.to(device)
    bias = None if bias is None else bias.to(device)
    out = poison_(torch.empty(*x.shape[:-1], CB.shape[0], dtype=x.dtype, device=device))
    y = K.int8_matmul(x, CB, SCB, threshold, bias, out=out,
                      plan_=path_plan(path, x.reshape(-1, x.shape[-1]).shape[0], CB.shape[0], CB.shape[1], x.device))
    assert y is out
    return y.cpu()


def assert_matches_reference(y, x, CB, SCB, threshold, bias):
    expected = reference(x, CB, SCB, threshold, bias)
    assert y.dtype == expected.dtype and y.shape == expected.shape
    assert not torch.isnan(y).any()
    _, _, cols = quantize_rows(x.reshape(-1, x.shape[-1]).half(), threshold)
    if cols is None or cols.numel() == 0:
        assert same_bits(y, expected), (y - expected).abs().max()
        return
    # Outlier columns: one ULP of x's dtype at the output's magnitude, plus the fp32 rounding of the
    # outlier products' sum (bounded by their magnitudes), which fp16/bf16 outputs round away.
    rows = x.reshape(-1, x.shape[-1]).double()
    w = (CB.double() * SCB.double()[:, None] / 127)[:, cols]
    outlier_mag = rows[:, cols].abs() @ w.abs().t()
    eps = torch.finfo(x.dtype).eps
    allowed = eps * expected.double().abs() + 4 * torch.finfo(torch.float32).eps * outlier_mag.reshape(expected.shape)
    diff = (y.double() - expected.double()).abs()
    assert (diff <= allowed).all(), (diff - allowed).max()
    if x.dtype != torch.float32:
        assert (y == expected).float().mean() >= 0.95


# (path, rows): one row (the quantize launch lists its columns), a few (the outlier epilogue launch), more
# (the list launch); M = 1, 3 and 17 as the issue asks.  The TMA path: test_tensor_descriptor_kernel.
CASES = [("gemm", 1), ("gemm", 3), ("gemm", 17)]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path, m", CASES)
def test_kernel_matches_reference(kdevice, path, m, dtype, threshold, bias):
    CB, SCB = weight()
    x = activations(m, dtype=dtype)
    b = torch.randn(N, dtype=dtype) if bias else None
    y = run_kernel(x, CB, SCB, threshold, b, path, kdevice)
    assert_matches_reference(y, x, CB, SCB, threshold, b)


@pytest.mark.parametrize("index", [0, 1])
def test_hopper_medium_tiles_match_the_reference(kdevice, index):
    """The 64-row tiles Hopper runs a few dozen to a few hundred rows with (codes of outlier columns zeroed)."""
    config = K.GEMM_MEDIUM_CONFIGS["hopper"][index]
    CB, SCB = weight()
    x = activations(70)
    bias = torch.randn(N, dtype=torch.float16)
    for threshold, b in ((6.0, bias), (0.0, None)):
        y = K.int8_matmul(x.to(kdevice), CB.to(kdevice), SCB.to(kdevice), threshold,
                          None if b is None else b.to(kdevice), plan_=Plan("gemm", config)).cpu()
        assert_matches_reference(y, x, CB, SCB, threshold, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, path", [(1, "gemm"), (3, "gemm"), (17, "gemm"), (70, "gemm"), (70, "gemm_tma")])
def test_norm_fused_into_the_quantize_launch(kdevice, m, path, dtype):
    """fused_add_rms_norm_int8_matmul: the quantize launch computes rms_norm(x + residual) itself (the single row's
    list program too), and the results are the bits of the norm kernel followed by the int8 matmul, with and
    without a threshold, on each of the quantize launch's forms (a row's list, a few rows' bit words and
    epilogue launch, the flags listed in the launch or by a list launch, the TMA kernel's zeroed columns)."""
    from anygpu.kernels.rms_norm import fused_add_rms_norm

    if path == "gemm_tma" and torch.device(kdevice).type == "cpu":
        chosen = Plan("gemm_tma", LaunchConfig({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2,
                                                "PER_SM": 1}))
    elif path == "gemm_tma":
        path_plan(path, m, N, 304, kdevice)  # skips where the path does not run
        chosen = Plan("gemm_tma", GEMM_TMA_CONFIGS["hopper"][0])
    else:
        chosen = path_plan(path, m, N, 304, kdevice)
    CB, SCB = weight(k=304)  # K a multiple of 16, for the TMA kernel
    res = torch.randn(m, 304)
    res[::2, 5], res[1::3, 200] = 40.0, -35.0  # outlier columns of the normed rows (|h| ~ 15 there, ~1 elsewhere)
    x, res = activations(m, k=304, dtype=dtype).to(kdevice), res.to(dtype).to(kdevice)
    w = (1 + 0.1 * torch.randn(304)).to(dtype).to(kdevice)
    bias = torch.randn(N, dtype=dtype).to(kdevice)
    CB, SCB = CB.to(kdevice), SCB.to(kdevice)
    set_plan_hook("int8_matmul", lambda *a: chosen)
    try:
        for threshold in (0.0, 6.0):
            y, r = K.fused_add_rms_norm_int8_matmul(x, res, w, 1e-5, CB, SCB, threshold, bias)
            h, r0 = fused_add_rms_norm(x, res, w, 1e-5)
            y0 = K.int8_matmul(h, CB, SCB, threshold, bias)
            assert same_bits(r.cpu(), r0.cpu()) and same_bits(y.cpu(), y0.cpu()), threshold
            assert_matches_reference(y.cpu(), h.cpu(), CB.cpu(), SCB.cpu(), threshold, bias.cpu())
            if threshold:
                _, _, cols = quantize_rows(h.cpu().half(), threshold)
                assert 0 < cols.numel() <= 2, cols  # the two planted columns (not in every row)
    finally:
        set_plan_hook("int8_matmul", None)


@pytest.mark.parametrize("zero_columns", [True, False], ids=["zeroed", "kept"])
def test_listing_in_the_launch_leaves_the_words_zero(kdevice, zero_columns):
    """Several rows: the quantize launch's last program lists the marked columns, zeroes their codes in every
    row and clears the device's bit words, so the next launch lists only its own columns; with the codes kept, the
    list launch lists them."""
    device = torch.device(kdevice)
    first, second = activations(40, outliers=False), activations(40, outliers=False)
    first[3, [5, 77, 250]] = 8.0
    second[39, [6, 299]] = -9.0
    second[0, 6] = 7.0
    for x, want in ((first, [5, 77, 250]), (second, [6, 299])):
        codes, stats, (cols, count) = Q.quantize_rows(x.to(device), 6.0, zero_columns=zero_columns)
        assert cols[: int(count)].tolist() == want
        ref, _, _ = quantize_rows(x.half(), 6.0)  # the op's reference zeroes the outlier columns' codes
        codes = codes.cpu()
        others = [c for c in range(KDIM) if c not in want]
        assert same_bits(codes[:, others], ref[:, others])
        if zero_columns:
            assert (codes[:, want] == 0).all()
        else:  # only the outlier entries' codes are 0: the others keep theirs
            kept = x[:, want].abs() < 6.0
            assert (codes[:, want][kept] != 0).float().mean() > 0.9 and (codes[:, want][~kept] == 0).all()
        words = Q._WORDS.get(cols.device)  # made by the first launch that lists in the launch
        assert (words is not None or not zero_columns) and (words is None or not words.any())


@pytest.mark.parametrize("k", [8200, 16400])
def test_listing_in_the_launch_walks_columns_past_one_step(kdevice, k):
    """Rows longer than the quantize's registers (MAX_BLOCK_K columns: two passes) and than one listing step of
    bit words (16400: twice MAX_BLOCK_K): the columns of every step listed in order, and zeroed."""
    x = torch.randn(17, k)
    x[3, 5] = 9.0
    x[16, k - 5] = -7.0
    x[0, 8192] = 6.5
    codes, _, (cols, count) = Q.quantize_rows(x.half().to(kdevice), 6.0, zero_columns=True)
    assert cols[: int(count)].tolist() == [5, 8192, k - 5]
    ref, _, _ = quantize_rows(x.half(), 6.0)
    assert same_bits(codes.cpu(), ref)  # the reference zeroes every code of its outlier columns


@pytest.mark.parametrize("in_launch", [True, False], ids=["listed-in-launch", "list-launch"])
@pytest.mark.parametrize("path, m", [("gemm", 33), ("gemm", 40), ("gemm", 3), ("gemm", 1)])
def test_every_loop_with_small_tiles(kdevice, path, m, in_launch, monkeypatch):
    """Small blocks, so each kernel's loops take several steps: the two-pass quantize, the outlier-column
    list over several blocks and programs (in the quantize launch's last program, or a launch of its own as on
    AMD GPUs), the K loop; more outlier columns than one dot step of the list takes."""
    monkeypatch.setattr(Q, "LIST_IN_LAUNCH_ROWS", Q.LIST_IN_LAUNCH_ROWS if in_launch else 0)
    monkeypatch.setattr(Q, "QUANTIZE_CONFIGS", {"default": (LaunchConfig({"MAX_BLOCK_K": 64}),)})
    monkeypatch.setattr(Q, "OUTLIER_LIST_CONFIGS", {"default": (LaunchConfig({"BLOCK_K": 64, "ZERO_ROWS": 3}),)})
    # 16-row tiles take the kept codes of outlier columns back out; 32-row tiles (m 40) have them zeroed
    config = LaunchConfig({"BLOCK_M": 32 if m == 40 else 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2})
    CB, SCB = weight()
    x = activations(m)
    x[:, 200:220:2] = 11.0  # 10 more outlier columns
    x[:, 40:70:5] = -8.0  # and 6 more: 19 in all, over several bit words (a dot step each)
    x[1:, 221:300:5] = 7.0  # and 16 more: 35, past the 32 the pointer kernel loads before its main loop
    bias = torch.randn(N, dtype=torch.float16)
    out = poison_(torch.empty(m, N, dtype=x.dtype, device=kdevice))
    y = K.int8_matmul(x.to(kdevice), CB.to(kdevice), SCB.to(kdevice), 6.0, bias.to(kdevice), out=out,
                      plan_=Plan(path, config)).cpu()
    assert_matches_reference(y, x, CB, SCB, 6.0, bias)
    y0 = K.int8_matmul(x.to(kdevice), CB.to(kdevice), SCB.to(kdevice), 0.0, None, plan_=Plan(path, config)).cpu()
    assert_matches_reference(y0, x, CB, SCB, 0.0, None)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [3, 40, 130])
def test_tensor_descriptor_kernel(kdevice, m, dtype, threshold, bias, config=0, swap=False):
    """The TMA kernel (NVIDIA sm_90's many-row path), with small tiles in the interpreter: persistent programs
    walking several tiles each (4 in the interpreter), K a multiple of 16 but of no block (the descriptors
    read zeros past K, M and N), outlier columns zeroed by the list launch and added back in x's dtype."""
    k = 336
    CB, SCB = weight(N, k)
    x = activations(m, k, dtype)
    x[:, 200:220:2] = 11.0  # 10 more outlier columns: more than one dot step of the list
    b = torch.randn(N, dtype=dtype) if bias else None
    if torch.device(kdevice).type == "cpu":
        chosen = Plan("gemm_tma", LaunchConfig({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2,
                                                "PER_SM": 2 if config in (1, 2) else 1, "SWAP": swap}))
    else:
        path_plan("gemm_tma", m, N, k, kdevice)  # skips where the path does not run
        chosen = Plan("gemm_tma", GEMM_TMA_CONFIGS["hopper"][config])
    out = poison_(torch.empty(m, N, dtype=dtype, device=kdevice))
    y = K.int8_matmul(x.to(kdevice), CB.to(kdevice), SCB.to(kdevice), threshold, None if b is None else b.to(kdevice),
                      out=out, plan_=chosen).cpu()
    assert_matches_reference(y, x, CB, SCB, threshold, b)


@pytest.mark.parametrize("m", [56, 64])
def test_tensor_descriptor_kernel_for_49_to_64_rows(kdevice, m):
    """Hopper's second TMA config (49-64 rows on narrower layers: two persistent programs an SM), on the GPU as
    the table has it; in the interpreter with small tiles, two programs per 'SM' walking the tiles."""
    test_tensor_descriptor_kernel(kdevice, m, torch.bfloat16, 6.0, True, config=1)


@pytest.mark.parametrize("m,config", [(100, 2), (100, 3), (200, 4)])
def test_tensor_descriptor_kernel_for_65_to_256_rows(kdevice, m, config):
    """Hopper's TMA configs for 65-256 rows: 64 x 64 tiles (PER_SM 2), and the weight tile as the MMA's
    first operand (SWAP, the sums transposed back for the epilogue); in the interpreter with small tiles."""
    swap = GEMM_TMA_CONFIGS["hopper"][config].constexprs.get("SWAP", False)
    assert swap == (config >= 3)
    test_tensor_descriptor_kernel(kdevice, m, torch.float16, 6.0, True, config=config, swap=swap)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threshold", [0.0, 3.0, 6.1])
@pytest.mark.parametrize("rows", [1, 7])  # one program (lists the columns itself), a program per row
def test_quantize_kernels_give_the_reference_codes(kdevice, dtype, threshold, rows, monkeypatch):
    """Row stats, codes and the ordered outlier columns are the reference's bits: round-half-even ties, a
    zero row, a threshold that fp16 rounds (6.1 -> 6.1015625).  The kernel keeps the codes of an outlier
    column's other entries (the matmul takes their products out); the reference zeroes them."""
    monkeypatch.setattr(Q, "OUTLIER_LIST_CONFIGS", {"default": (LaunchConfig({"BLOCK_K": 64, "ZERO_ROWS": 3}),)})
    monkeypatch.setattr(Q, "QUANTIZE_CONFIGS", {"default": (LaunchConfig({"MAX_BLOCK_K": 64}),)})  # 3 passes
    x = torch.randn(rows, 150) * 2
    x[0, :4] = torch.tensor([127.0, 2.5, 3.5, -0.5])  # absmax 127: scale 1, codes of exact ties
    x[0, 140] = -7.0  # an outlier column in the last, partial, bit word
    if rows > 3:
        x[1] = 0.0
        x[2, 9] = 6.1015625  # == fp16(6.1)
        x[3, 10] = 6.09765625  # the fp16 value below it
        x[5, 70] = 40.0
    x = x.to(dtype)
    thr = fp16_threshold(threshold) if threshold else 0.0
    codes, stats, outliers = Q.quantize_rows(x.to(kdevice), thr)
    zeroed = Q.quantize_rows(x.to(kdevice), thr, zero_columns=True)[0]  # rows > 1: outlier columns zeroed
    expected_codes, expected_stats, expected_cols = quantize_rows(x.half(), threshold)
    assert torch.equal(zeroed.cpu(), expected_codes if rows > 1 else codes.cpu())
    assert same_bits(stats.cpu(), expected_stats)
    kept = torch.zeros(150, dtype=torch.bool)
    if threshold:
        cols, count = outliers
        assert torch.equal(cols[:count.item()].cpu().long(), expected_cols) and expected_cols.numel() >= 1
        kept[expected_cols] = True
        outlier_entries = x.half().abs() >= thr
        assert not codes.cpu()[outlier_entries].any()
    else:
        assert outliers is None
    assert torch.equal(codes.cpu()[:, ~kept], expected_codes[:, ~kept])
    if rows > 1 and threshold:  # mark_only: the same codes, the outlier entries in the rows' bit words
        marked, marked_stats, words = Q.quantize_rows(x.to(kdevice), thr, mark_only=True)
        outlier_entries = x.half().abs() >= thr
        assert same_bits(marked_stats.cpu(), expected_stats) and torch.equal(marked.cpu(), codes.cpu())
        words = words.view(torch.int32).cpu().view(rows, -1)
        bits = (words[:, :, None] >> torch.arange(32)) & 1  # bit j of word i: column 32 i + j
        assert torch.equal(bits.reshape(rows, -1)[:, :150].bool(), outlier_entries)


def test_shapes_strides_and_empty_inputs(kdevice):
    CB, SCB = weight()
    bias = torch.randn(N, dtype=torch.bfloat16)  # a bias in another dtype than x, as matmul_8bit allows
    x = activations(6).reshape(2, 3, KDIM)
    y = K.int8_matmul(x.to(kdevice), CB.to(kdevice), SCB.to(kdevice), 6.0, bias.to(kdevice)).cpu()
    assert y.shape == (2, 3, N)
    assert_matches_reference(y, x, CB, SCB, 6.0, bias)
    wide = torch.randn(4, 2 * KDIM, dtype=torch.float16)[:, ::2]  # unit stride broken: copied
    torch.testing.assert_close(K.int8_matmul(wide.to(kdevice), CB.to(kdevice), SCB.to(kdevice)).cpu(),
                               reference(wide, CB, SCB), rtol=0, atol=0)
    rows = torch.randn(4, KDIM + 50, dtype=torch.float16)[:, :KDIM]  # a row stride > K
    torch.testing.assert_close(K.int8_matmul(rows.to(kdevice), CB.to(kdevice), SCB.to(kdevice)).cpu(),
                               reference(rows, CB, SCB), rtol=0, atol=0)
    empty = K.int8_matmul(torch.empty(0, KDIM, dtype=torch.float16, device=kdevice), CB.to(kdevice), SCB.to(kdevice))
    assert empty.shape == (0, N)
    no_k = K.int8_matmul(torch.empty(3, 0, device=kdevice), torch.empty(N, 0, dtype=torch.int8, device=kdevice),
                         SCB.to(kdevice), 6.0, bias.to(kdevice)).cpu()
    assert torch.equal(no_k, bias.float().expand(3, N))
    with pytest.raises(ValueError, match="out: expected a contiguous torch.float16 tensor of shape"):
        K.int8_matmul(x.to(kdevice), CB.to(kdevice), SCB.to(kdevice), out=torch.empty(2, 3, N, device=kdevice))
    with pytest.raises(ValueError, match="plan: expected a path of"):
        K.int8_matmul(x.to(kdevice), CB.to(kdevice), SCB.to(kdevice), plan_=Plan("fused", LaunchConfig()))


@pytest.mark.parametrize("m", [2, 3, 16])
def test_a_few_rows_finish_in_the_outlier_epilogue(kdevice, m, monkeypatch):
    """2..16 rows with a threshold: the matmul stores its int32 sums and the epilogue launch lists the outlier
    columns (several list steps, more columns than its head), takes the kept codes' products out and adds the
    fp part; as with OUTLIER_EPILOGUE_ROWS = 0 (the list launch before the matmul, its own epilogue)."""
    monkeypatch.setattr(E, "OUTLIER_EPILOGUE_CONFIGS", {"default": (LaunchConfig({"BLOCK_N": 16, "LIST_K": 64}),)})
    calls = []
    epilogue = K.outlier_epilogue
    monkeypatch.setattr(K, "outlier_epilogue", lambda *a: calls.append(a[6].numel()) or epilogue(*a))
    CB, SCB = weight()
    x = activations(m)
    x[m - 1, 200:300:3] = -6.5  # 34 more outlier columns, in the last row only (the others' codes are kept)
    bias = torch.randn(N, dtype=torch.float16)
    y = run_kernel(x, CB, SCB, 6.0, bias, "gemm", kdevice)
    assert calls == [m * ((KDIM + 31) // 32) * 4]  # the rows' bit words, as int8 storage
    assert_matches_reference(y, x, CB, SCB, 6.0, bias)
    assert_matches_reference(run_kernel(x, CB, SCB, 6.0, None, "gemm", kdevice), x, CB, SCB, 6.0, None)
    clean = activations(m, outliers=False) * 0.1  # no outlier column: the epilogue alone
    assert_matches_reference(run_kernel(clean, CB, SCB, 6.0, None, "gemm", kdevice), clean, CB, SCB, 6.0, None)
    assert len(calls) == 3
    monkeypatch.setattr(K, "OUTLIER_EPILOGUE_ROWS", 0)
    listed = run_kernel(x, CB, SCB, 6.0, bias, "gemm", kdevice)
    assert len(calls) == 3
    assert_matches_reference(listed, x, CB, SCB, 6.0, bias)


def test_every_column_an_outlier(kdevice):
    """A threshold below every |x|: all columns go through x's dtype, the int8 part is empty."""
    CB, SCB = weight()
    x = activations(3, outliers=False) + 0.5 * torch.sign(activations(3, outliers=False))
    y = run_kernel(x, CB, SCB, 0.25, None, "gemm", kdevice)
    assert_matches_reference(y, x, CB, SCB, 0.25, None)


def test_plan_picks_paths_by_rows():
    cpu = torch.device("cpu")
    # the GEMM path at every M (measured fastest on the H200); small and large tile tables split at 64 rows
    assert {plan(m, 8192, 8192, torch.float16, cpu).path for m in (1, 2, 3, 16, 17, 64, 65, 4096)} == {"gemm"}
    assert plan(64, 64, 64, torch.float16, cpu).config is K.GEMM_SMALL_CONFIGS["default"][0]
    assert plan(65, 64, 64, torch.float16, cpu).config is K.GEMM_LARGE_CONFIGS["default"][0]
    chosen = Plan("gemm", K.GEMM_LARGE_CONFIGS["default"][0])
    set_plan_hook("int8_matmul", lambda m, n, k, dtype, device: chosen if m > 1 else None)
    try:
        assert plan(5, 64, 64, torch.float16, cpu) is chosen and plan(1, 64, 64, torch.float16, cpu).path == "gemm"
    finally:
        set_plan_hook("int8_matmul", None)
    with pytest.raises(ValueError, match="kernel: expected one of"):
        set_plan_hook("int8", None)
    # many rows on NVIDIA sm_90: the tensor-descriptor kernel, where K keeps codes rows 16-byte aligned
    from anygpu.backend.targets import TARGETS

    hopper = TARGETS["sm_90"]
    assert K._plan(4096, 8192, 8192, hopper).path == "gemm_tma"
    assert K._plan(65, 28672, 4096, hopper).config is GEMM_TMA_CONFIGS["hopper"][0]
    # a few dozen to a few hundred rows: 64-row tiles, except narrow layers up to 64 rows (small tiles) and
    # wide ones from 65 rows (the TMA kernel)
    medium = K.GEMM_MEDIUM_CONFIGS["hopper"]
    tma = GEMM_TMA_CONFIGS["hopper"]  # [1]: 49-64 rows, [2]-[4] 65-256 rows, on layers narrower than TMA_N
    for m, n, k, want in ((48, 8192, 8192, K.GEMM_SMALL_CONFIGS["nvidia"][0]), (49, 8192, 8192, tma[1]),
                          (64, 6144, 4096, tma[1]), (64, 4096, 14336, tma[1]),  # K % 16 != 0: no TMA
                          (64, 4096, 14344, K.GEMM_SMALL_CONFIGS["nvidia"][0]), (64, 8192, 8200, medium[0]),
                          (65, 8192, 8192, tma[3]), (65, 8192, 8200, medium[0]), (129, 8192, 8200, medium[1]),
                          (64, 28672, 4096, medium[0]), (48, 4096, 14336, K.GEMM_SMALL_CONFIGS["nvidia"][0]),
                          (65, 4096, 14336, tma[2]), (128, 4096, 4096, tma[2]), (128, 6144, 4096, tma[3]),
                          (129, 4096, 4096, tma[3]), (256, 6144, 4096, tma[4]), (256, 8192, 8192, tma[4]),
                          (128, 28672, 4096, tma[0]), (257, 6144, 4096, tma[0])):
        assert K._plan(m, n, k, hopper).config is want, (m, n, k)
    for m, k, arch in ((4096, 8200, "sm_90"), (4096, 8192, "sm_80"), (4096, 8192, "gfx942"), (4096, 8192, "gfx950")):
        assert K._plan(m, 8192, k, TARGETS[arch]).path == "gemm", (k, arch)
    for arch in ("sm_80", "gfx942", "gfx1100"):  # the medium bucket is Hopper's alone
        assert K._plan(64, 8192, 8192, TARGETS[arch]).config is select(K.GEMM_SMALL_CONFIGS, TARGETS[arch])[0]
    with pytest.raises(ValueError, match="'gemm_tma' runs on NVIDIA sm_90"):
        plan_for("gemm_tma", 4096, 64, 64, cpu)
    for gone in ("dequant", "fused", "fused_stats", "int_mm"):
        with pytest.raises(ValueError, match="path: expected one of"):
            plan_for(gone, 1, 8, 8, cpu)
    assert fp16_threshold(6.1) == 6.1015625 and fp16_threshold(1e6) == float("inf")


# -- the op and matmul_8bit -------------------------------------------------------------------------


def test_op_reference_is_matmul_8bit_on_the_cpu():
    from anygpu.quant import matmul_8bit

    CB, SCB = weight()
    x = activations(5)
    bias = torch.randn(N, dtype=torch.float16)
    for threshold in (0.0, 6.0):
        assert same_bits(int8_matmul_op(x, CB, SCB, threshold, bias), matmul_8bit(x, CB, SCB, threshold, bias))
        expected = reference(x, CB, SCB, threshold, bias)
        assert same_bits(torch.ops.anygpu.int8_matmul(x, CB, SCB, threshold, bias), expected)


def test_op_opcheck_and_errors():
    CB, SCB = weight(8, 32)
    x = torch.randn(3, 32, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    torch.library.opcheck(int8_matmul_op.overload, (x, CB, SCB, 6.0, bias))
    y = int8_matmul_op(x, CB, SCB, 0.0, bias)
    y.sum().backward()
    w = CB.float() * (SCB[:, None] * (1 / 127))
    torch.testing.assert_close(x.grad, torch.ones(3, 8) @ w)
    torch.testing.assert_close(bias.grad, torch.full((8,), 3.0))
    with pytest.raises(ValueError, match=r"CB: expected an int8 \[N, 32\] weight"):
        int8_matmul_op(x, CB.float(), SCB)
    with pytest.raises(ValueError, match="SCB: expected 8 fp32 row scales"):
        int8_matmul_op(x, CB, SCB[:4])
    with pytest.raises(ValueError, match="threshold: expected a number >= 0"):
        int8_matmul_op(x, CB, SCB, -1.0)
    with pytest.raises(ValueError, match="bias: expected 8 float values"):
        int8_matmul_op(x, CB, SCB, 0.0, torch.ones(7))
    meta = int8_matmul_op(torch.empty(2, 5, 32, device="meta", dtype=torch.bfloat16), CB.to("meta"), SCB.to("meta"))
    assert meta.shape == (2, 5, 8) and meta.dtype == torch.bfloat16


def test_bench_suite_runs_on_the_cpu():
    from anygpu import bench

    report = bench.run("int8", quick=True, device=torch.device("cpu"), progress=False, warmup_ms=0, rep_ms=1)
    assert [row["op"] for row in report.rows] == ["linear8bit"] * 3
    for row in report.rows:
        assert row["ours"]["ms"] > 0 and row["baselines"]["F.linear float32"]["ratio"] > 0


# -- cross-compilation (no GPU needed) -----------------------------------------------------------------


SPECS = ("int8_matmul_gemm_small", "int8_matmul_gemm", "int8_matmul_gemm_tma", "int8_quantize_rows",
         "int8_outlier_list", "int8_outlier_epilogue")


@pytest.mark.aot
def test_int8_kernels_cross_compile_for_every_ci_target():
    """The int8 kernels alone (test_aot.py compiles every kernel): every config, dtype, aligned or not."""
    from anygpu.backend.targets import parse_target_list
    from anygpu.kernels.aot import cross_compile
    from anygpu.kernels.launch import registered

    specs = {name: spec for name, spec in registered().items() if name in SPECS}
    assert sorted(specs) == sorted(SPECS)
    reports = cross_compile(parse_target_list("ci"), specs)
    failed = [r for r in reports if not r.ok]
    assert not failed, failed


@pytest.mark.aot
def test_nvidia_code_rounds_as_the_reference():
    """On sm_90: IEEE division and round-to-nearest-even in the quantization, and, with the launcher's
    options, no FMA contraction (``acc * s + bias`` must round twice, as the reference does)."""
    import triton
    from triton.compiler import ASTSource

    from anygpu.backend.targets import TARGETS
    from anygpu.kernels.launch import select

    target = TARGETS["sm_90"]

    def ptx(spec, pick=0, **extra):
        cfg = select(spec.configs, target)[pick]
        src = ASTSource(fn=spec.fn, signature=spec.signature(torch.float16), constexprs=dict(cfg.constexprs))
        return triton.compile(src, target=target.triton_target(), options={**cfg.options(target), **extra}).asm["ptx"]

    quantize = ptx(Q.QUANTIZE_SPEC, enable_fp_fusion=False)
    # rounding by adding and subtracting 1.5 * 2**23 (0f4B400000): the constant must survive, not be folded
    assert "div.rn.f32" in quantize and "0f4B400000" in quantize
    gemm = ptx(K.GEMM_SPEC, enable_fp_fusion=False)
    assert "fma.rn.f32" not in gemm
    assert "fma.rn.f32" in ptx(K.GEMM_SPEC, enable_fp_fusion=True)  # the check above can fail
    # sm_90 launches the small-M matmul as a programmatic dependent: it prefetches its weights, then waits
    small = ptx(K.GEMM_SMALL_SPEC, enable_fp_fusion=False, launch_pdl=True)
    assert "prefetch.global.L2" in small and "griddepcontrol.wait" in small
    assert small.index("prefetch.global.L2") < small.index("griddepcontrol.wait")
    assert "griddepcontrol.launch_dependents" in small  # after its main loop: the next quantize may launch
    # the quantize launch waits for the launch before it (x), then lets the next start after its loads
    assert "griddepcontrol.wait" in quantize and "griddepcontrol.launch_dependents" in quantize
    assert quantize.index("griddepcontrol.wait") < quantize.index("ld.global")
    listing = ptx(Q.OUTLIER_LIST_SPEC, pick=-1)  # the bit-words form, a programmatic dependent of quantize's
    assert "griddepcontrol.wait" in listing and "griddepcontrol.launch_dependents" in listing
    # a few rows with a threshold: the matmul stores int32 sums and lets the epilogue launch start right after
    # its own wait; the epilogue lists and gathers (loads) before it waits for those sums
    int32_out = ptx(K.GEMM_SMALL_SPEC, pick=-1, enable_fp_fusion=False, launch_pdl=True)
    assert int32_out.index("griddepcontrol.wait") < int32_out.index("griddepcontrol.launch_dependents")
    epilogue = ptx(OUTLIER_EPILOGUE_SPEC, enable_fp_fusion=False, launch_pdl=True)
    assert "ld.global" in epilogue[:epilogue.index("griddepcontrol.wait")]
    assert "griddepcontrol.launch_dependents" in epilogue and "fma.rn.f32" not in epilogue


def test_programmatic_dependent_launch_only_where_it_exists(monkeypatch):
    """PDL (and its prefetch) on NVIDIA sm_90 and later only; ANYGPU_INT8_PDL=0 turns it off."""
    from anygpu.backend.targets import TARGETS

    pytest.importorskip("triton.backends.nvidia.compiler")
    uses_pdl = K.uses_pdl.__wrapped__
    cuda = torch.device("cuda", 0)
    for arch, expected in (("sm_90", True), ("sm_100", True), ("sm_80", False), ("gfx942", False), ("gfx950", False)):
        if arch not in TARGETS:
            continue
        monkeypatch.setattr(K, "device_target", lambda device, arch=arch: TARGETS[arch])
        assert uses_pdl(cuda) is expected, arch
    monkeypatch.setenv("ANYGPU_INT8_PDL", "0")
    monkeypatch.setattr(K, "device_target", lambda device: TARGETS["sm_90"])
    assert uses_pdl(cuda) is False
    monkeypatch.delenv("ANYGPU_INT8_PDL")
    monkeypatch.setattr(K, "device_target", lambda device: None)  # the CPU (the interpreter)
    assert uses_pdl(torch.device("cpu")) is False


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 1024), (1000, 999)])
@pytest.mark.parametrize("m", [1, 2, 3, 16, 17, 300])
def test_gpu_paths_match_the_cpu_reference(m, n, k):
    CB, SCB = weight(n, k)
    for dtype in (torch.float16, torch.bfloat16):
        x = activations(m, k, dtype)
        bias = torch.randn(n, dtype=dtype)
        for path in PATHS:
            try:
                plan_for(path, m, n, k, torch.device("cuda"))
            except ValueError:  # a path that does not take this shape
                continue
            for threshold in (0.0, 6.0):
                y = run_kernel(x, CB, SCB, threshold, bias, path, "cuda")
                assert_matches_reference(y, x, CB, SCB, threshold, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 300])
def test_linear8bitlt_forward_captures_in_a_cuda_graph(m):
    """No step of any path reads a value back to the host: the forward captures, and replays follow the
    input's outlier columns."""
    from anygpu.nn import Linear8bitLt

    source = torch.nn.Linear(1024, 512).half().cuda().requires_grad_(False)
    layer = Linear8bitLt.from_linear(source, threshold=6.0).requires_grad_(False)
    x = activations(m, 1024).cuda()
    layer(x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    for seed in range(3):
        torch.manual_seed(seed)
        fresh = torch.randn(m, 1024) * 2
        fresh[:, torch.randperm(1024)[:seed * 5]] = 10.0
        x.copy_(fresh.half())
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(y.cpu(), x.cpu(), layer.weight.data.cpu(), layer.weight.SCB.cpu(), 6.0,
                                 source.bias.cpu())


@pytest.mark.aot
def test_listing_counts_bits_with_popc_on_nvidia_only():
    """NVIDIA lists outlier columns counting bits with its popc instruction (``POPC``); AMD (and the
    interpreter) with SWAR arithmetic, the same counts (the GPU tests check the lists against the reference)."""
    import triton
    from triton.compiler import ASTSource

    from anygpu.backend.targets import TARGETS
    from anygpu.kernels.launch import select

    for arch in ("gfx942", "gfx90a", "gfx1100", "gfx950"):
        for spec in (Q.QUANTIZE_SPEC, Q.OUTLIER_LIST_SPEC):
            assert not any(cfg.constexprs.get("POPC") for cfg in select(spec.configs, TARGETS[arch]))
    for arch in ("sm_80", "sm_90"):
        target = TARGETS[arch]
        for spec, dtype, listing in ((Q.QUANTIZE_SPEC, torch.float16, lambda c: c["LIST"]),
                                     (Q.OUTLIER_LIST_SPEC, torch.int8, lambda c: not c["ZERO"])):
            cfg = next(c for c in select(spec.configs, target) if listing(c.constexprs))
            assert cfg.constexprs["POPC"]
            src = ASTSource(fn=spec.fn, signature=spec.signature(dtype), constexprs=dict(cfg.constexprs))
            ptx = triton.compile(src, target=target.triton_target(), options=cfg.options(target)).asm["ptx"]
            assert "popc.b32" in ptx, (arch, spec.name)


def test_fused_norm_op_is_the_two_ops_on_the_cpu():
    """The op's CPU path is fused_add_rms_norm then int8_matmul, bit for bit, and it refuses bad arguments by name."""
    from anygpu.ops import fused_add_rms_norm, fused_add_rms_norm_int8_matmul

    CB, SCB = weight()
    x, res = activations(4, dtype=torch.bfloat16), torch.randn(4, KDIM).bfloat16()
    w = torch.rand(KDIM) + 0.5
    for threshold, bias in ((0.0, None), (6.0, torch.randn(N))):
        y, r = fused_add_rms_norm_int8_matmul(x, res, w, 1e-6, CB, SCB, threshold, bias)
        h, r0 = fused_add_rms_norm(x, res, w, 1e-6)
        assert same_bits(r, r0) and same_bits(y, int8_matmul_op(h, CB, SCB, threshold, bias))
    torch.library.opcheck(fused_add_rms_norm_int8_matmul.overload, (x, res, w, 1e-6, CB, SCB, 6.0, None))
    with pytest.raises(ValueError, match="residual: expected a torch.bfloat16 tensor of x's shape"):
        fused_add_rms_norm_int8_matmul(x, res[:2], w, 1e-6, CB, SCB)
    with pytest.raises(ValueError, match="CB: expected an int8"):
        fused_add_rms_norm_int8_matmul(x, res, w, 1e-6, CB.float(), SCB)
    with pytest.raises(ValueError, match="eps: expected a finite number"):
        fused_add_rms_norm_int8_matmul(x, res, w, -1.0, CB, SCB)
    with pytest.raises(ValueError, match=r"^norm_weight: expected shape \(300,\)"):
        fused_add_rms_norm_int8_matmul(x, res, w[:7], 1e-6, CB, SCB)


@pytest.mark.gpu
def test_engine_tokens_are_the_same_with_the_norm_fused(monkeypatch):
    """An int8 model's decoder runs its qkv and gate/up norms inside the quantize launch (models/projection.py):
    the greedy tokens of a small random model (bf16, CUDA graphs) are those of the unfused norms."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from anygpu.models import projection

    from .test_pdl import random_engine_tokens

    calls = []
    fused = projection.fused_add_rms_norm_int8_matmul
    monkeypatch.setattr(projection, "fused_add_rms_norm_int8_matmul", lambda *a: calls.append(1) or fused(*a))
    results = []
    for flag in (True, False):
        monkeypatch.setattr(projection, "FUSE_NORM_INTO_INT8", flag)
        results.append(random_engine_tokens("int8"))
        assert bool(calls) == flag
        calls.clear()
    assert results[0] == results[1] and len(results[0]) == 3
