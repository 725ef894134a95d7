"""The CPU weight cache (``anygpu/nn/_cpu_weight_cache.py``) for the GGUF block layers: ``GGUF8bitLinear``
(``--quantize q8_0``, the 5- to 8-bit types) and ``GGUF4bitLinear`` (``q4_0``, ``q4_k``) keep their dequantized
weight, which gives the op's own result bit for bit (the oracle: the op with the cache out of the way, which
test_matmul_int8_block.py and test_matmul_4bit_offset.py hold to gguf-py), rebuilt when the weight changes, within the
budget the 4-bit layers share.
"""

import copy
import gc

import pytest
import torch

from anygpu.nn import _cpu_weight_cache as cache
from anygpu.nn.linear_gguf_4bit import GGUF4bitLinear
from anygpu.nn.linear_gguf_8bit import GGUF8bitLinear
from anygpu.ops.matmul_4bit import matmul_4bit
from anygpu.ops.matmul_int8_block import matmul_int8_block


@pytest.fixture(autouse=True)
def _budget():
    previous = cache.set_limit(1 << 30)
    yield
    cache.set_limit(previous)


def _gguf_layer(type_name="Q8_0", n=40, k=256, bias=True):
    torch.manual_seed(0)
    cls = GGUF4bitLinear if type_name.startswith("Q4") else GGUF8bitLinear
    return cls.from_linear(torch.nn.Linear(k, n, bias=bias), type_name)


def _gguf_op(layer, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    if isinstance(layer, GGUF4bitLinear):
        return matmul_4bit(x, layer.packed, layer.absmax, layer.code, 32, layer.out_features, layer.in_features,
                           bias, offset=layer.offset)
    return matmul_int8_block(x, layer.codes, layer.scale, layer.blocksize, bias, layer.offset)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_cached_weight_gives_the_op_bit_for_bit(type_name, dtype):
    layer = _gguf_layer(type_name)
    for m in (1, 5, 129):
        x = torch.randn(m, 256, dtype=dtype)
        got = layer(x)
        assert layer._cpu_weight is not None and layer._cpu_weight.dtype == dtype
        assert torch.equal(got, _gguf_op(layer, x)), m


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_gguf_rebuilds_on_changes_and_keeps_gradients(type_name):
    layer = _gguf_layer(type_name)
    x = torch.randn(3, 256)
    first = layer(x)
    (layer.absmax if type_name == "Q4_K" else layer.scale).mul_(2)  # an in-place write bumps the version counter
    assert torch.equal(layer(x), _gguf_op(layer, x)) and not torch.equal(layer(x), first)
    with torch.inference_mode():  # built in inference mode, then used by a training step
        layer.load_state_dict(_gguf_layer(type_name).state_dict())
        layer(x)
    xg = torch.randn(2, 256, requires_grad=True)
    layer(xg).square().sum().backward()
    expected = xg.detach().requires_grad_(True)
    _gguf_op(layer, expected).square().sum().backward()
    torch.testing.assert_close(xg.grad, expected.grad, rtol=1e-6, atol=1e-6)


def test_budget_is_shared_and_given_back():
    gc.collect()
    per_gguf = 40 * 256 * 4
    cache.set_limit(cache.used() + per_gguf + 10)  # room for one more (earlier tests' layers may live)
    a, b = _gguf_layer(), _gguf_layer("Q4_0")
    x = torch.randn(1, 256)
    a(x)
    yb = b(x)
    assert a._cpu_weight is not None and b._cpu_weight is None
    assert torch.equal(yb, _gguf_op(b, x))  # over the budget: the op, uncached
    assert copy.deepcopy(a)._cpu_weight is None  # copies leave the cache behind
    del a
    gc.collect()
    b(x)
    assert b._cpu_weight is not None
