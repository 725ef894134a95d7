"""Triton kernels against their references: on the GPU, or on the CPU in Triton's interpreter."""

import pytest
import torch

from anygpu.ops.silu_and_mul import reference as silu_reference
from anygpu.testing import assert_accurate, poison_, reference_dtype

pytest.importorskip("triton")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SHAPES = [(1, 2), (3, 2 * 1), (5, 2 * 37), (4, 2 * 1024), (2, 3, 2 * 2500), (0, 8)]


def torch_silu_and_mul(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul_kernel(kdevice, dtype, shape):
    from anygpu.kernels.silu_and_mul import silu_and_mul

    x = (torch.randn(shape) * 4).to(dtype).to(kdevice)
    out = poison_(torch.empty(*shape[:-1], shape[-1] // 2, dtype=dtype, device=kdevice))
    y = silu_and_mul(x, out=out)
    assert y is out and not torch.isnan(y).any()
    oracle = torch_silu_and_mul(x.to(reference_dtype(dtype)))
    assert_accurate(y, torch_silu_and_mul(x), oracle, what=f"{dtype} {shape}")
    # Same math as the reference (in fp32, rounded once to dtype): a few units in the last place apart.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y, silu_reference(x), rtol=4 * eps, atol=4 * eps)


def test_silu_and_mul_kernel_non_contiguous_input(kdevice):
    from anygpu.kernels.silu_and_mul import silu_and_mul

    x = torch.randn(2 * 40, 7, device=kdevice).t()  # last dim stride != 1
    torch.testing.assert_close(silu_and_mul(x), silu_reference(x))
    x = torch.randn(9, 2 * 40, device=kdevice)[::2]  # row stride 2 rows
    torch.testing.assert_close(silu_and_mul(x), silu_reference(x))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernel_runs_on_the_tensors_gpu_not_the_current_one():
    from anygpu.kernels.silu_and_mul import silu_and_mul

    x = torch.randn(7, 2 * 300, device="cuda:1")
    assert torch.cuda.current_device() == 0
    y = silu_and_mul(x)
    assert y.device == x.device
    torch.testing.assert_close(y, silu_reference(x))
    with pytest.raises(ValueError, match="out: expected .* on cuda:1"):
        silu_and_mul(x, out=torch.empty(7, 300, device="cuda:0"))


def test_silu_and_mul_kernel_rejects_bad_out(kdevice):
    from anygpu.kernels.silu_and_mul import silu_and_mul

    x = torch.randn(4, 16, device=kdevice)
    with pytest.raises(ValueError, match="out: expected a contiguous torch.float32 tensor of shape"):
        silu_and_mul(x, out=torch.empty(4, 9, device=kdevice))


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 9), d=st.integers(1, 700), lead=st.integers(1, 3),
       dtype=st.sampled_from(DTYPES), scale=st.floats(0.01, 30.0))
def test_silu_and_mul_kernel_any_shape(rows, d, lead, dtype, scale):
    from anygpu.kernels.silu_and_mul import silu_and_mul
    from anygpu.testing import kernel_device

    dev = kernel_device()
    if dev is None:
        pytest.skip("Triton kernels cannot run here")
    x = (torch.randn(lead, rows, 2 * d) * scale).to(dtype).to(dev)
    out = poison_(torch.empty(lead, rows, d, dtype=dtype, device=dev))
    oracle = torch_silu_and_mul(x.to(reference_dtype(dtype)))
    assert_accurate(silu_and_mul(x, out=out), torch_silu_and_mul(x), oracle, what=f"{dtype} {tuple(x.shape)}")
