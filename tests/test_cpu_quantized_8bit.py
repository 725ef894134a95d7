"""The CPU weight cache (``anygpu/nn/_cpu_weight_cache.py``) for the 8-bit layers: ``Linear8bitLt`` on a CPU without
a fast ``torch._int_mm`` keeps its codes as fp32, ``GGUF8bitLinear`` its dequantized weight.  Either gives the op's
own result bit for bit (the oracle: the op with the cache out of the way, which test_int8.py and
test_matmul_int8_block.py hold to bitsandbytes and gguf-py), one build per weight, rebuilt when the weight changes.

Whether ``_int_mm`` is fast depends on the CPU (AVX-512 or not): the tests that need the cached path fake an AVX2
CPU, as the ROCm logic is tested with faked device properties.
"""

import copy
import gc

import pytest
import torch

import anygpu.nn.linear8bit as linear8bit_module
from anygpu.nn import Linear8bitLt
from anygpu.nn import _cpu_weight_cache as cache
from anygpu.nn.linear_gguf_8bit import GGUF8bitLinear
from anygpu.ops.int8_matmul import int8_matmul
from anygpu.ops.matmul_int8_block import matmul_int8_block


@pytest.fixture(autouse=True)
def _budget():
    previous = cache.set_limit(1 << 30)
    yield
    cache.set_limit(previous)


@pytest.fixture
def avx2(monkeypatch):
    """A CPU whose ``torch._int_mm`` is slow: the layer keeps fp32 codes."""
    monkeypatch.setattr(linear8bit_module, "int_mm_applies", lambda *args: False)


def _int8_layer(n=48, k=1536, bias=True, threshold=6.0, seed=0) -> Linear8bitLt:
    torch.manual_seed(seed)
    dense = torch.nn.Linear(k, n, bias=bias)
    layer = Linear8bitLt(k, n, bias=bias, has_fp16_weights=False, threshold=threshold)
    layer.load_state_dict(dense.state_dict())
    return layer.to("cpu")  # quantizes


def _int8_op(layer: Linear8bitLt, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return int8_matmul(x, layer.weight.data, layer.weight.SCB, layer.threshold, bias)


@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [96, 1536, 2100])  # one K slice of exact fp32 products, two, three (a partial one)
def test_int8_cached_codes_give_the_op_bit_for_bit(avx2, threshold, dtype, k):
    layer = _int8_layer(k=k, threshold=threshold)
    for m in (1, 7, 300):
        x = torch.randn(m, k, dtype=dtype) * 3  # some entries past the threshold: outlier columns
        with torch.inference_mode():
            got = layer(x)
        assert layer._cpu_weight is not None and layer._cpu_weight.weight.dtype == torch.float32
        assert torch.equal(got, _int8_op(layer, x)), (m, k)


def test_int8_one_build_then_rebuilt_on_a_new_weight(avx2):
    layer, other = _int8_layer(), _int8_layer(seed=1)
    x = torch.randn(2, 1536)
    with torch.no_grad():
        layer(x)
        entry, used = layer._cpu_weight, cache.used()
        assert used >= 48 * 1536 * 4
        for _ in range(3):
            layer(x)
        assert layer._cpu_weight is entry and cache.used() == used
        layer.load_state_dict(other.state_dict())
        assert layer._cpu_weight is None  # dropped at once, not at the next call
        assert torch.equal(layer(x), _int8_op(other, x))
        layer.weight.data = layer.weight.data.flip(0).contiguous()  # new storage, same Parameter object
        assert torch.equal(layer(x), _int8_op(layer, x))


def test_int8_not_cached_with_grad_or_a_fast_int_mm(monkeypatch):
    layer = _int8_layer()
    x = torch.randn(2, 1536)
    monkeypatch.setattr(linear8bit_module, "int_mm_applies", lambda *args: True)
    with torch.no_grad():
        layer(x)
    assert layer._cpu_weight is None  # AVX-512: _int_mm reads the int8 codes themselves
    monkeypatch.setattr(linear8bit_module, "int_mm_applies", lambda *args: False)
    x.requires_grad_(True)
    layer(x).sum().backward()  # autograd runs the op (its backward formula)
    assert layer._cpu_weight is None and x.grad is not None


def test_int8_copies_leave_the_cache_behind(avx2):
    layer = _int8_layer()
    with torch.no_grad():
        layer(torch.randn(1, 1536))
    assert copy.deepcopy(layer)._cpu_weight is None
    layer.to("cpu")
    assert layer._cpu_weight is None


def _gguf_layer(type_name="Q8_0", n=40, k=256, bias=True) -> GGUF8bitLinear:
    torch.manual_seed(0)
    return GGUF8bitLinear.from_linear(torch.nn.Linear(k, n, bias=bias), type_name)


def _gguf_op(layer: GGUF8bitLinear, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return matmul_int8_block(x, layer.codes, layer.scale, layer.blocksize, bias, layer.offset)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_8bit_cached_weight_gives_the_op_bit_for_bit(type_name, dtype):
    layer = _gguf_layer(type_name)
    for m in (1, 5, 129):
        x = torch.randn(m, 256, dtype=dtype)
        got = layer(x)
        assert layer._cpu_weight is not None and layer._cpu_weight.dtype == dtype
        assert torch.equal(got, _gguf_op(layer, x)), m


def test_gguf_8bit_rebuilds_on_changes_and_keeps_gradients():
    layer = _gguf_layer()
    x = torch.randn(3, 256)
    first = layer(x)
    layer.scale.mul_(2)  # an in-place write bumps the version counter
    assert torch.equal(layer(x), _gguf_op(layer, x)) and not torch.equal(layer(x), first)
    with torch.inference_mode():  # built in inference mode, then used by a training step
        layer.load_state_dict(_gguf_layer().state_dict())
        layer(x)
    xg = torch.randn(2, 256, requires_grad=True)
    layer(xg).square().sum().backward()
    expected = xg.detach().requires_grad_(True)
    _gguf_op(layer, expected).square().sum().backward()
    torch.testing.assert_close(xg.grad, expected.grad, rtol=1e-6, atol=1e-6)


def test_budget_is_shared_and_given_back(avx2):
    gc.collect()
    per_int8, per_gguf = 48 * 1536 * 4, 40 * 256 * 4
    cache.set_limit(cache.used() + per_int8 + per_gguf + 10)
    a, g, b = _int8_layer(), _gguf_layer(), _int8_layer(seed=2)
    with torch.no_grad():
        a(torch.randn(1, 1536))
        g(torch.randn(1, 256))
        x = torch.randn(1, 1536)
        yb = b(x)
    assert a._cpu_weight is not None and g._cpu_weight is not None and b._cpu_weight is None
    assert torch.equal(yb, _int8_op(b, x))  # over the budget: the op, uncached
    del a
    gc.collect()
    with torch.no_grad():
        b(x)
    assert b._cpu_weight is not None
