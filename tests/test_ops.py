"""Every op: torch.library registration (opcheck), reference accuracy, argument errors, autograd."""

import pytest
import torch
import torch.nn.functional as F

from anygpu.ops import ALL_OPS, silu_and_mul
from anygpu.testing import assert_accurate, reference_dtype

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def test_registered_in_torch_library():
    assert torch.ops.anygpu.silu_and_mul.default is silu_and_mul.overload
    assert ALL_OPS["silu_and_mul"] is silu_and_mul
    for name, op in ALL_OPS.items():
        assert getattr(torch.ops.anygpu, name).default is op.overload


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    x = torch.randn(3, 5, 2 * 24, device=device, dtype=dtype, requires_grad=True)
    torch.library.opcheck(silu_and_mul.overload, (x,))


def torch_same_dtype(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def oracle(x):
    return torch_same_dtype(x.to(reference_dtype(x.dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (7, 2 * 37), (2, 3, 2 * 1000)])
def test_reference_within_rule(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    assert_accurate(silu_and_mul(x), torch_same_dtype(x), oracle(x), what=f"{dtype} {shape}")


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"x: expected a last dimension of even size 2\*d, got shape \(3, 7\)"):
        silu_and_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="x: expected dtype float16, bfloat16 or float32, got torch.int32"):
        silu_and_mul(torch.ones(3, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="x: expected a last dimension"):
        silu_and_mul(torch.tensor(1.0))


def test_meta_and_compile():
    y = silu_and_mul(torch.empty(4, 10, device="meta", dtype=torch.bfloat16))
    assert y.shape == (4, 5) and y.dtype == torch.bfloat16
    compiled = torch.compile(lambda t: silu_and_mul(t) * 2, fullgraph=True, backend="eager")
    x = torch.randn(4, 10)
    torch.testing.assert_close(compiled(x), silu_and_mul(x) * 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_backward_matches_autograd_of_the_math(device):
    x = torch.randn(6, 2 * 33, device=device, requires_grad=True)
    g = torch.randn(6, 33, device=device)
    silu_and_mul(x).backward(g)
    x2 = x.detach().double().requires_grad_()
    torch_same_dtype(x2).backward(g.double())
    torch.testing.assert_close(x.grad.double(), x2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dispatch_runs_the_triton_kernel(dtype, monkeypatch):
    from anygpu.kernels.silu_and_mul import silu_and_mul as kernel

    x = torch.randn(33, 2 * 1000, device="cuda", dtype=dtype)
    torch.testing.assert_close(silu_and_mul(x), kernel(x), rtol=0, atol=0)
    monkeypatch.setenv("ANYGPU_KERNELS", "reference")
    assert_accurate(silu_and_mul(x), torch_same_dtype(x), oracle(x))


def test_accuracy_rule_cannot_be_passed_by_garbage_when_torch_overflows():
    from anygpu.testing import error_report

    x = torch.tensor([[300.0, 2.0, 300.0, 3.0]], dtype=torch.float16)  # silu(300) * 300 overflows fp16
    ours, theirs, exact = silu_and_mul(x), torch_same_dtype(x), oracle(x)
    assert torch.isinf(theirs[0, 0])
    assert error_report(ours, theirs, exact).ok
    assert not error_report(torch.full_like(ours, float("nan")), theirs, exact).ok
    assert not error_report(torch.zeros_like(ours), theirs, exact).ok
    garbage = ours.clone()
    garbage[0, 1] = 7.0  # finite where torch is finite, but wrong
    assert not error_report(garbage, theirs, exact).ok


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_in_place_change_after_forward_is_caught(device):
    x = torch.randn(4, 16, device=device, requires_grad=True)
    b = x * 1.0
    y = silu_and_mul(b)
    b.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.gpu
def test_vmap_and_trace_go_through_the_dispatcher():
    x = torch.randn(3, 5, 2 * 40, device="cuda")
    torch.testing.assert_close(torch.func.vmap(silu_and_mul)(x), silu_and_mul(x))
    traced = torch.jit.trace(lambda t: silu_and_mul(t), (x,))
    torch.testing.assert_close(traced(x), silu_and_mul(x))


@pytest.mark.gpu
def test_bad_kernels_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv("ANYGPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="ANYGPU_KERNELS='fast': expected 'triton'"):
        silu_and_mul(torch.randn(2, 8, device="cuda"))


def test_ops_take_keywords_and_schema_defaults():
    from anygpu.ops import gelu_and_mul

    x = torch.randn(3, 8)
    torch.testing.assert_close(gelu_and_mul(x, approximate="tanh"), gelu_and_mul(x, "tanh"))
    torch.testing.assert_close(gelu_and_mul(x), gelu_and_mul(x, "none"))
    torch.testing.assert_close(gelu_and_mul(x=x), gelu_and_mul(x))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['foo'\]"):
        gelu_and_mul(x, foo=1)
    with pytest.raises(TypeError, match=r"multiple values for arguments \['x'\]"):
        gelu_and_mul(x, x=x)
    with pytest.raises(TypeError, match="missing required argument 'x'"):
        gelu_and_mul()
