"""Linear4bit's CPU weight cache (``anygpu/nn/_cpu_weight_cache.py``): the same bits as the op's reference, one
build per weight, rebuilt when the weight changes, never in the state_dict, and gradients still reach x.

The oracle is ``anygpu.quant.matmul.matmul_4bit`` with the cache out of the way: on the CPU that is the op's
reference, ``F.linear(x, dequant(W))``, which test_matmul_4bit.py and test_nn_4bit.py hold to bitsandbytes.
"""

import copy
import gc

import pytest
import torch

from anygpu.nn import Linear4bit, Params4bit
from anygpu.nn import _cpu_weight_cache as cache
from anygpu.quant.matmul import matmul_4bit


@pytest.fixture(autouse=True)
def _budget():
    """A known budget for each test (the default depends on the machine's RAM), restored after."""
    previous = cache.set_limit(1 << 30)
    yield
    cache.set_limit(previous)


def _layer(n=40, k=96, quant_type="nf4", nested=True, bias=True, compute_dtype=None) -> Linear4bit:
    layer = Linear4bit(k, n, bias=bias, quant_type=quant_type, compress_statistics=nested, compute_dtype=compute_dtype)
    return layer.to("cpu")  # quantizes


def _uncached(layer: Linear4bit, x: torch.Tensor) -> torch.Tensor:
    """What forward computed before the cache: the op, with the layer's compute-dtype rules."""
    dtype = layer.compute_dtype or x.dtype
    bias = layer.bias.to(dtype) if layer.bias is not None else None
    return matmul_4bit(x.to(dtype), layer.weight.data, layer.weight.quant_state, bias=bias).to(x.dtype)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(40, 96), (33, 575), (576, 1536)])  # partial blocks, odd K, a SmolLM2 shape
def test_cached_forward_is_the_reference_bit_for_bit(quant_type, nested, dtype, shape):
    n, k = shape
    compute = torch.float16 if dtype == torch.float16 else None  # fp16 without compute_dtype warns (tested elsewhere)
    layer = _layer(n, k, quant_type, nested, compute_dtype=compute)
    for m in (1, 7, 300):
        x = torch.randn(m, k, dtype=dtype)
        got = layer(x)
        assert layer._cpu_weight is not None  # the cached path ran
        assert torch.equal(got, _uncached(layer, x)), (m, k)


@pytest.mark.parametrize("compute_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_repeated_calls_follow_the_compute_dtype_rules(compute_dtype, x_dtype):
    """Calls after the first (Linear4bit's cached shortcut where it applies) cast x, a bias of another dtype and
    the output as the first call does."""
    layer = _layer(compute_dtype=compute_dtype)
    layer.bias.data = layer.bias.data.to(torch.bfloat16 if x_dtype == torch.float32 else torch.float32)
    layer(torch.randn(1, 96, dtype=x_dtype))  # sets the compute dtype and builds the cache
    for m in (1, 3):
        x = torch.randn(m, 96, dtype=x_dtype)
        got = layer(x)
        assert got.dtype == x_dtype
        assert torch.equal(got, _uncached(layer, x)), m


def test_one_build_per_weight():
    layer = _layer()
    x = torch.randn(2, 96)
    layer(x)
    entry, used = layer._cpu_weight, cache.used()
    assert used >= 40 * 96 * 4
    for _ in range(3):
        layer(x)
    assert layer._cpu_weight is entry and cache.used() == used


def test_load_state_dict_rebuilds():
    layer, other = _layer(), _layer()
    x = torch.randn(3, 96)
    before = layer(x)
    layer.load_state_dict(other.state_dict())
    after = layer(x)
    assert torch.equal(after, _uncached(other, x))
    assert not torch.equal(after, before)


def test_in_place_writes_and_new_weights_rebuild():
    layer = _layer(bias=False)
    x = torch.randn(3, 96)
    first = layer(x)
    layer.weight.quant_state.absmax.mul_(2)  # nested: uint8 codes of absmax; any write bumps the version counter
    assert not torch.equal(layer(x), first)
    assert torch.equal(layer(x), _uncached(layer, x))
    with torch.no_grad():
        layer.weight.data = layer.weight.data.flip(0).contiguous()  # new storage, same Parameter object
    assert torch.equal(layer(x), _uncached(layer, x))
    fresh = _layer(bias=False)
    layer.weight = Params4bit(fresh.weight.data, quant_state=fresh.weight.quant_state, bnb_quantized=True,
                              quant_type="nf4", module=layer)
    assert torch.equal(layer(x), fresh(x))


def test_moves_and_dtype_changes_drop_or_rebuild():
    layer = _layer()
    x = torch.randn(2, 96)
    layer(x)
    layer.to("cpu")
    assert layer._cpu_weight is None  # _apply dropped it
    layer(x)
    y16 = layer(x.bfloat16())  # compute dtype was adopted as fp32 from the first input: bf16 is upcast
    assert torch.equal(y16, _uncached(layer, x.bfloat16()))


def test_state_dict_is_unchanged_by_the_cache():
    layer = _layer()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer(torch.randn(2, 96))
    after = layer.state_dict()
    assert list(after) == list(before)
    for key in before:
        assert torch.equal(after[key], before[key]), key
    assert copy.deepcopy(layer)._cpu_weight is None  # copies and pickles leave the cache behind


@pytest.mark.parametrize("built_in_inference_mode", [False, True])
def test_gradients_flow_to_x_and_bias(built_in_inference_mode):
    layer = _layer()
    layer.bias.requires_grad_(True)
    if built_in_inference_mode:  # an engine warm-up before training: the cached weight must still be saveable
        with torch.inference_mode():
            layer(torch.randn(1, 96))
    x = torch.randn(5, 96, requires_grad=True)
    layer(x).square().sum().backward()
    assert layer._cpu_weight is not None
    grad_x, grad_b = x.grad.clone(), layer.bias.grad.clone()

    x.grad = None
    layer.bias.grad = None
    cache.set_limit(0)
    layer._cpu_weight = None
    layer(x).square().sum().backward()  # the op's autograd formula
    assert layer._cpu_weight is None
    torch.testing.assert_close(x.grad, grad_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, grad_b, rtol=1e-6, atol=1e-6)
    assert layer.weight.grad is None


def test_budget_is_respected_and_given_back():
    gc.collect()
    cache.set_limit(cache.used() + 40 * 96 * 4 + 10)  # room for one more fp32 weight (earlier tests' layers may live)
    a, b = _layer(), _layer()
    x = torch.randn(2, 96)
    ya, yb = a(x), b(x)
    assert a._cpu_weight is not None and b._cpu_weight is None  # b runs uncached: same result
    assert torch.equal(yb, _uncached(b, x))
    used = cache.used()
    del a
    gc.collect()
    assert cache.used() == used - 40 * 96 * 4
    b(x)
    assert b._cpu_weight is not None  # room again


def test_budget_settings():
    with pytest.raises(ValueError, match="nbytes"):
        cache.set_limit(-1)
    with pytest.raises(ValueError, match="nbytes"):
        cache.set_limit(1.5)


def test_environment_budget(monkeypatch):
    monkeypatch.setenv("ANYGPU_CPU_WEIGHT_CACHE_MB", "1.5")
    assert cache._default_limit() == int(1.5 * 2**20)
    monkeypatch.setenv("ANYGPU_CPU_WEIGHT_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="ANYGPU_CPU_WEIGHT_CACHE_MB"):
        cache._default_limit()
    monkeypatch.delenv("ANYGPU_CPU_WEIGHT_CACHE_MB")
    assert cache._default_limit() > 0
