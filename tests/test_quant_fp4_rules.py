"""FP4's per-device rule: the kernel's GPU rules (bitsandbytes' csrc/kernels.cu ``dQuantizeFP4``, as hipcc and
as nvcc --use_fast_math build it) against the PyTorch transcription in ``ops/quantize_4bit.py``, run in the
interpreter on the CPU; the device choice; and what the rules decide at thresholds, ties, zeros and absmax."""

import numpy as np
import pytest
import torch

from anygpu.ops.quantize_4bit import (FP4_KERNELS_CU, FP4_KERNELS_CU_FTZ, FP4_REFERENCE, FLT_MIN, codes_4bit,
                                      fp4_rule, pack)
from anygpu.ops.quant_common import scale_blocks, sorted_4bit
from anygpu.testing import same_bits

GPU_RULES = (FP4_KERNELS_CU, FP4_KERNELS_CU_FTZ)
# dQuantizeFP4's literals, as written in csrc/kernels.cu
CUDA_LITERALS = ("0.00260417", "0.0859375", "0.20833333", "0.29166667", "0.4166667", "0.583333", "0.8333333")


def f32(v: float) -> float:
    return float(np.float32(v))


def codes(x, rule, blocksize=64):
    return codes_4bit(x, blocksize, "fp4", rule)[0][:x.numel()]


def thresholds(device="cpu"):
    return torch.tensor([float(np.float32(lit)) for lit in CUDA_LITERALS], device=device)


def adversarial(device="cpu"):
    """Blocks of 64 with absmax 1: every threshold (the CUDA and the reference ones) and its neighbours, ties,
    both zeros, tiny values of both signs, a negative absmax element; fp32 scaling is exact here."""
    t = thresholds(device)
    mids = sorted_4bit("fp4", device)[0]
    near = torch.cat([t, mids, -t, -mids])
    near = torch.cat([near, torch.nextafter(near, near + 1), torch.nextafter(near, near - 1)])
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 0.5833331, -0.5833331, 1 / 384, -1 / 384,
                            0.0859375, -0.0859375, 1 - 2 ** -24, -(1 - 2 ** -24)], device=device)
    values = torch.cat([near, special])
    values = torch.cat([values, values.new_zeros(-values.numel() % 63)]).view(-1, 63)
    ones = torch.ones(values.shape[0], 1, device=device)
    ones[1::2] = -1.0  # the absmax element: +1 in even blocks, -1 in odd ones
    return torch.cat([ones, values], 1).flatten()


def test_kernel_literals_are_kernels_cu_rounded_to_fp32():
    pytest.importorskip("triton")
    from anygpu.kernels.quant_4bit import FLT_MIN as KERNEL_FLT_MIN
    from anygpu.kernels.quant_4bit import FP4_CUDA_THRESHOLDS

    assert same_bits(torch.tensor(FP4_CUDA_THRESHOLDS, dtype=torch.float32), thresholds())
    assert KERNEL_FLT_MIN == FLT_MIN == float(torch.finfo(torch.float32).tiny)
    # a few ulps below the reference's midpoints, except 0.0859375 and 0.4166667, which are the midpoints
    mids = sorted_4bit("fp4")[0][8:]
    assert (thresholds().view(torch.int32) - mids.view(torch.int32)).tolist() == [14, 0, -1, -1, 0, -6, -1]


def test_the_kernel_and_the_reference_choose_the_rule_alike(monkeypatch):
    pytest.importorskip("triton")
    from anygpu.kernels import quant_4bit as k

    assert (k.FP4_REFERENCE, k.FP4_KERNELS_CU, k.FP4_KERNELS_CU_FTZ) == (FP4_REFERENCE, *GPU_RULES)
    for hip, expected in ((None, FP4_KERNELS_CU_FTZ), ("6.4", FP4_KERNELS_CU)):
        monkeypatch.setattr(torch.version, "hip", hip)
        for device, rule in ((torch.device("cpu"), FP4_REFERENCE), (torch.device("cuda", 0), expected)):
            assert k.fp4_rule_for(device) == fp4_rule(device) == rule


@pytest.mark.parametrize("rule", GPU_RULES)
def test_the_rules_decide_as_documented(rule):
    x = adversarial()
    got, ref = codes(x, rule), codes(x, FP4_REFERENCE)
    t = thresholds()
    by_value = dict(zip(x.tolist(), got.tolist()))  # equal values, equal codes (also checks the rule is pointwise)
    assert by_value[1.0] == 3 and by_value[-1.0] == 11  # the absmax element
    assert by_value[0.0] == 0 and codes(torch.tensor([1.0, -0.0]), rule)[1] == 0  # -0 is not < 0
    assert [by_value[f32(v)] for v in (1e-30, -1e-30, 1e-3, -1e-3)] == [0, 8, 0, 8]
    assert [ref[x == f32(v)].unique().tolist() for v in (1e-30, -1e-30)] == [[8], [0]]  # reversed there
    # strict >: a value on a threshold takes the lower magnitude, the next float up the higher one
    magnitudes = [0, 1, 6, 7, 4, 5, 2, 3]
    for i, v in enumerate(t.tolist()):
        up = torch.nextafter(t[i], torch.tensor(2.0)).item()
        assert (by_value[v], by_value[up], by_value[-v], by_value[-up]) == (
            magnitudes[i], magnitudes[i + 1], 8 + magnitudes[i], 8 + magnitudes[i + 1])
    # between a CUDA threshold and the reference's midpoint the two disagree
    assert by_value[f32(0.5833331)] == 2 and ref[x == f32(0.5833331)].unique().tolist() == [5]
    assert codes(torch.tensor([1.0, float("nan")]), rule)[1] == 0  # no comparison holds for NaN


@pytest.mark.parametrize("rule", GPU_RULES)
def test_rules_agree_with_the_reference_except_tiny_values_and_near_thresholds(rule):
    torch.manual_seed(1)
    x = torch.randn(64 * 512)
    got, ref = codes(x, rule), codes(x, FP4_REFERENCE)
    scaled = scale_blocks(x, 64)[0]
    differ = got != ref
    assert 0.003 < differ.float().mean() < 0.008  # the H200's 99.50 % agreement
    assert torch.all(scaled[differ].abs() <= 1 / 384) and torch.all((got[differ] == 0) | (got[differ] == 8))


def test_flush_to_zero_only_in_the_nvcc_rule():
    tiny = float(torch.finfo(torch.float32).smallest_normal)
    # a subnormal input (absmax < 1: the product is normal), a subnormal product, a block with absmax > 2**126
    x = torch.tensor([1e-3, -1e-40, -1e-3, -tiny])
    y = torch.tensor([1e30, -1e-10, 3.0, -1.0] + [0.0] * 60 + [3e38, -1.0, 0.5, -3e38])
    assert codes(x, FP4_KERNELS_CU).tolist() == [3, 8, 11, 8] and codes(x, FP4_KERNELS_CU_FTZ).tolist() == [3, 0, 11, 8]
    assert codes(y, FP4_KERNELS_CU)[:4].tolist() == [3, 8, 0, 8]  # 3 / 1e30 and 1 / 1e30: below 1/384
    assert codes(y, FP4_KERNELS_CU_FTZ)[:4].tolist() == [3, 0, 0, 8]  # -1e-10 / 1e30 is subnormal: -0
    assert codes(y, FP4_KERNELS_CU)[64:].tolist() == [3, 8, 0, 11]
    assert codes(y, FP4_KERNELS_CU_FTZ)[64:].tolist() == [0, 0, 0, 0]  # 1 / 3e38 flushes: 0 * x everywhere


def kernel_codes(x, blocksize, rule):
    from anygpu.kernels.quant_4bit import quantize_4bit

    packed, absmax = quantize_4bit(x, blocksize, "fp4", torch.uint8, fp4_rule=rule)
    return packed, absmax


@pytest.mark.parametrize("rule", (FP4_REFERENCE, *GPU_RULES))
@pytest.mark.parametrize("blocksize,dtype,n", [(64, torch.float16, 64 * 40 + 3), (128, torch.bfloat16, 128 * 9),
                                               (32, torch.float32, 32 * 17 + 7), (256, torch.bfloat16, 1001)])
def test_kernel_rules_match_the_transcription_on_random_data(kdevice, rule, blocksize, dtype, n):
    torch.manual_seed(blocksize + n)
    x = (torch.randn(n) * 2).to(dtype).to(kdevice)
    packed, absmax = kernel_codes(x, blocksize, rule)
    ref_codes, ref_absmax = codes_4bit(x, blocksize, "fp4", rule)
    assert same_bits(packed, pack(ref_codes, torch.uint8)) and same_bits(absmax, ref_absmax)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy: inf * 0
@pytest.mark.parametrize("rule", (FP4_REFERENCE, *GPU_RULES))
def test_kernel_rules_match_the_transcription_on_adversarial_values(kdevice, rule):
    tiny = float(torch.finfo(torch.float32).smallest_normal)
    rows = [[1e-3, -1e-40, -1e-3, -tiny, 1e-40, 0.0, -0.0, 5e-4], [1e30, -1e-10, 3.0, -1.0, 0.0, -0.0, 1e-45, -1e-45],
            [3e38, -1.0, 0.5, -3e38, 1e-40, 2.0, -2.0, 1.0], [1e-3, -1e-40, float("inf"), -2.0, 0.0, -0.0, 1.0, 0.1],
            [float("nan"), 1.0, -1.0, 0.0, 0.1, -0.1, 0.2, 0.3], [0.0] * 8]
    edge = torch.tensor([row + [0.0] * 24 for row in rows]).flatten()  # one row a block of 32
    for x in (adversarial(), edge, edge[:-33]):
        x = x.to(kdevice)
        for blocksize in (32, 64):
            packed, absmax = kernel_codes(x, blocksize, rule)
            assert same_bits(packed, pack(codes_4bit(x, blocksize, "fp4", rule)[0], torch.uint8)), (rule, blocksize)
