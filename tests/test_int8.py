"""LLM.int8() (anygpu.quant.int8, Int8Params, Linear8bitLt, quantize_model "int8") on the CPU, with the real
bitsandbytes as the oracle.  Tolerances are bitsandbytes' own (reference sheet section 14)."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from anygpu.nn import Int8Params, Linear8bitLt, quantize_model
from anygpu.quant import (int8_linear_matmul, int8_mm_dequant, int8_vectorwise_dequant, int8_vectorwise_quant,
                          matmul_8bit)
from anygpu.quant import int8 as int8_module

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is the compatibility oracle (test extra)")
import bitsandbytes.functional as BF  # noqa: E402
from anygpu.testing import same_bits  # noqa: E402

IN, OUT = 96, 40


@pytest.fixture(scope="module", autouse=True)
def _eager():
    """bitsandbytes wraps some CPU paths in torch.compile: eager gives the same numbers, much sooner."""
    with torch.compiler.set_stance("force_eager"):
        yield


def activations(rows=32, cols=IN, dtype=torch.float16, outlier_cols=(3, 17)):
    x = torch.randn(rows, cols)
    for c in outlier_cols:
        x[::3, c] = 8.0 * torch.sign(x[::3, c])  # a few large values in a few columns, as in LLMs
    return x.to(dtype)


# -- int8_vectorwise_quant / dequant -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threshold", [0.0, 2.0, 3.0, 6.0, 100.0])
def test_vectorwise_quant_matches_bitsandbytes(dtype, threshold):
    A = activations(dtype=dtype)
    before = A.clone()
    codes, stats, cols = int8_vectorwise_quant(A, threshold)
    bcodes, bstats, bcols = BF.int8_vectorwise_quant(A.clone(), threshold)
    assert same_bits(A, before)  # the input is never modified
    assert codes.dtype == torch.int8 and stats.dtype == torch.float32
    assert same_bits(stats, bstats)  # stats exact
    assert (codes.int() - bcodes.int()).abs().max() <= 1  # codes within 1 LSB (bitsandbytes' tests' bound)
    assert torch.equal(codes, bcodes)  # in fact identical to its reference backend
    if threshold == 0:
        assert cols is None and bcols is None
    else:
        assert cols.dtype == torch.int64 and torch.equal(cols, bcols)
        assert not codes[:, cols].any()  # outlier columns zeroed whole
    if threshold == 100.0:
        assert cols.numel() == 0  # no outliers: an empty tensor, not None


def test_vectorwise_quant_shapes_and_zero_rows():
    A = torch.randn(2, 3, 16, dtype=torch.float16)
    A[1, 2] = 0
    codes, stats, _ = int8_vectorwise_quant(A)
    assert codes.shape == A.shape and stats.shape == (6,)
    assert stats[5] == 0 and not codes[1, 2].any()  # an all-zero row gives codes 0, not NaN casts
    flat, flat_stats, _ = BF.int8_vectorwise_quant(A.reshape(6, 16).clone())
    assert torch.equal(codes.reshape(6, 16)[:5], flat[:5]) and same_bits(stats[:5], flat_stats[:5])
    # the outlier columns' other values still count in their row's absmax (only the outliers themselves do not)
    row = torch.tensor([[1.0, 5.0, -2.0], [0.5, 0.5, 0.25]], dtype=torch.float16)
    codes, stats, cols = int8_vectorwise_quant(row, 3.0)
    assert cols.tolist() == [1] and stats.tolist() == [2.0, 0.5] and codes[:, 1].tolist() == [0, 0]


def test_vectorwise_dequant_matches_bitsandbytes():
    codes, stats, _ = int8_vectorwise_quant(torch.randn(24, 40, dtype=torch.float16) * 3)
    ours, theirs = int8_vectorwise_dequant(codes, stats), BF.int8_vectorwise_dequant(codes, stats)
    assert ours.dtype == torch.float32 and same_bits(ours, theirs)


# -- int8_linear_matmul / int8_mm_dequant ------------------------------------------------------------


@pytest.mark.parametrize("shape", [(40, 499, 24), (33, 512, 64), (3, 499, 5), (1, 8, 8), (17, 1100, 16)])
@pytest.mark.parametrize("path", ["int_mm", "fallback"])
def test_int8_linear_matmul_is_exact(shape, path, monkeypatch):
    if path == "fallback":
        monkeypatch.setattr(int8_module, "_int_mm_applies", lambda *args: False)
    M, K, N = shape
    A = torch.randint(-128, 128, (M, K), dtype=torch.int8)
    B = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    expected = (A.double() @ B.double().t()).to(torch.int32)  # exact: every partial sum fits a float64
    got = int8_linear_matmul(A, B)
    assert got.dtype == torch.int32 and torch.equal(got, expected)
    if K < 1040:  # bitsandbytes' fp32 product is exact only below that
        assert torch.equal(got, BF.int8_linear_matmul(A, B))
    A3 = A.reshape(1, M, K).expand(2, M, K)  # batched and non-contiguous
    assert torch.equal(int8_linear_matmul(A3, B), expected.expand(2, M, N))
    out = torch.empty(M, N, dtype=torch.int32)
    assert int8_linear_matmul(A, B, out=out) is out and torch.equal(out, expected)


@pytest.mark.parametrize("K", [1024, 1025, 3000])
@pytest.mark.parametrize("value", [-128, 127])
def test_int8_fp32_products_stay_exact_at_the_extremes(K, value):
    """The CPU's fp32 path (slices of EXACT_FP32_K) with every product at its largest magnitude, where one fp32
    sum over all of K would round (3000 * 128**2 > 2**24)."""
    from anygpu.ops.int8_matmul import int_matmul

    A = torch.full((3, K), value, dtype=torch.int8)
    B = torch.cat([torch.full((2, K), value, dtype=torch.int8), torch.full((1, K), -128, dtype=torch.int8)])
    B[2, ::2] = 127
    assert torch.equal(int_matmul(A, B, use_int_mm=False), (A.double() @ B.double().t()).to(torch.int32))


def test_cpu_int_mm_only_with_avx512(monkeypatch):
    """torch._int_mm is the CPU's int8 GEMM only where it is fast (AVX-512); elsewhere the exact fp32 products."""
    import importlib

    module = importlib.import_module("anygpu.ops.int8_matmul")  # the module (anygpu.ops.int8_matmul is the op)
    for capability, expected in (("AVX512", True), ("AVX2", False), ("DEFAULT", False), ("SVE256", False)):
        module._cpu_int_mm_is_fast.cache_clear()
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert module.int_mm_applies(1, 64, 64, torch.device("cpu")) is expected, capability
    module._cpu_int_mm_is_fast.cache_clear()


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_mm_dequant_matches_bitsandbytes(out_dtype, with_bias):
    x, w = torch.randn(32, 64, dtype=torch.float16), torch.randn(48, 64, dtype=torch.float16)
    CA, SCA, _ = int8_vectorwise_quant(x)
    CB, SCB, _ = int8_vectorwise_quant(w)
    acc = int8_linear_matmul(CA, CB)
    bias = torch.randn(48, dtype=torch.float16) if with_bias else None
    ours = int8_mm_dequant(acc, SCA, SCB, bias=bias, dtype=out_dtype)
    assert ours.dtype == (out_dtype or torch.float16)
    theirs = torch.ops.bitsandbytes.int8_mm_dequant(acc, SCA, SCB, dtype=out_dtype or torch.float16, bias=bias)
    step = 8e-3 if out_dtype == torch.bfloat16 else 2e-3  # the constants differ by 1.8e-5: at most an output ULP
    torch.testing.assert_close(ours.float(), theirs.float(), atol=step, rtol=step)
    if out_dtype is None:
        torch.testing.assert_close(ours, BF.int8_mm_dequant(acc, SCA, SCB, bias=bias), atol=2e-3, rtol=2e-3)
    # exactly the product of the dequantized operands, up to the output dtype's rounding
    exact = (int8_vectorwise_dequant(CA, SCA).double() @ int8_vectorwise_dequant(CB, SCB).double().t())
    if bias is not None:
        exact += bias.double()
    out_dtype = out_dtype or torch.float16
    tolerance = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[out_dtype]
    torch.testing.assert_close(ours.double(), exact, atol=tolerance * 4, rtol=tolerance)
    reference = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert (ours.float() - reference).abs().mean() < 0.015 * reference.abs().mean()  # int8 error: ~1 % of |y|


# -- matmul_8bit (MatMul8bitLt) ----------------------------------------------------------------------------


def bnb_matmul(x, CB, SCB, threshold, bias):
    state = bnb.MatmulLtState()
    state.CB, state.SCB, state.threshold = CB, SCB, threshold
    state.has_fp16_weights, state.is_training = False, False  # MatMul8bitLt on the CPU too, not MatMul8bitFp
    return bnb.matmul(x, CB, state=state, threshold=threshold, bias=bias)


@pytest.mark.parametrize("threshold", [0.0, 3.0, 6.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matmul_8bit_matches_bitsandbytes(threshold, dtype):
    w = (torch.randn(OUT, IN) / IN**0.5).half()
    CB, SCB, _ = int8_vectorwise_quant(w)
    x = activations(dtype=dtype).reshape(4, 8, IN)
    bias = torch.randn(OUT, dtype=dtype)
    ours = matmul_8bit(x, CB, SCB, threshold, bias)
    with torch.no_grad():
        theirs = bnb_matmul(x, CB, SCB, threshold, bias)
    assert ours.dtype == dtype == theirs.dtype and ours.shape == (4, 8, OUT)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-3 if dtype != torch.bfloat16 else 2e-2, rtol=2e-3)
    reference = F.linear(x.float(), w.float(), bias.float())
    if threshold:  # outliers in fp16: within bitsandbytes' outlier-test tolerance of the full-precision result
        torch.testing.assert_close(ours.float(), reference, atol=0.05, rtol=0.05)
    else:  # the outlier columns' int8 error shows: the mixed decomposition is what fixes it
        mixed = matmul_8bit(x, CB, SCB, 6.0, bias).float()
        assert (ours.float() - reference).abs().max() > (mixed - reference).abs().max()


def test_matmul_8bit_without_outliers_is_within_fp16_tolerance():
    w = (torch.randn(OUT, IN) / IN**0.5).half()
    x = torch.randn(16, IN, dtype=torch.float16)
    CB, SCB, _ = int8_vectorwise_quant(w)
    for threshold in (0.0, 6.0):
        y = matmul_8bit(x, CB, SCB, threshold)
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=0.03, rtol=0.05)


@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_matmul_8bit_gradients_match_bitsandbytes(threshold):
    w = (torch.randn(OUT, IN) / IN**0.5).half()
    CB, SCB, _ = int8_vectorwise_quant(w)
    x = activations(dtype=torch.float16)
    bias = torch.randn(OUT, dtype=torch.float16)
    grad = torch.randn(x.shape[0], OUT, dtype=torch.float16)
    xs, biases = [x.clone().requires_grad_(), x.clone().requires_grad_()], [bias.clone().requires_grad_() for _ in "ab"]
    matmul_8bit(xs[0], CB, SCB, threshold, biases[0]).backward(grad)
    bnb_matmul(xs[1], CB, SCB, threshold, biases[1]).backward(grad)
    assert same_bits(xs[0].grad, xs[1].grad)  # grad_out @ (CB * SCB / 127), the same arithmetic
    assert same_bits(biases[0].grad, biases[1].grad)
    # vs the full-precision weight: grads ~0.65 here, each summing 40 weights quantized with a step of absmax / 127
    torch.testing.assert_close(xs[0].grad.float(), grad.float() @ w.float(), atol=0.02, rtol=0.05)


def test_matmul_8bit_trains_a_full_precision_weight():
    w = (torch.randn(OUT, IN) / IN**0.5).requires_grad_()
    x = torch.randn(8, IN)
    CB, SCB, _ = int8_vectorwise_quant(w.detach().half())
    grad = torch.randn(8, OUT)
    matmul_8bit(x, CB, SCB, 0.0, B=w).backward(grad)
    torch.testing.assert_close(w.grad, grad.t() @ x)


@pytest.mark.parametrize("call, message", [
    (lambda: int8_vectorwise_quant(torch.ones(4, 4, dtype=torch.int32)), "A: expected dtype"),
    (lambda: int8_vectorwise_quant(torch.ones(4, 4), -1.0), "threshold: expected a number >= 0"),
    (lambda: int8_vectorwise_quant(torch.ones(0, 4)), "A: expected a non-empty tensor"),
    (lambda: int8_vectorwise_dequant(torch.ones(4, 4, dtype=torch.int8), torch.ones(3)), "stats: expected 4"),
    (lambda: int8_linear_matmul(torch.ones(4, 8), torch.ones(4, 8, dtype=torch.int8)), "A: expected dtype"),
    (lambda: int8_linear_matmul(torch.ones(4, 8, dtype=torch.int8), torch.ones(4, 7, dtype=torch.int8)),
     r"B: expected \[N, 8\]"),
    (lambda: int8_linear_matmul(torch.ones(4, 8, dtype=torch.int8), torch.ones(4, 8, dtype=torch.int8),
                                dtype=torch.float32), "dtype: expected torch.int32"),
    (lambda: int8_mm_dequant(torch.ones(4, 8, dtype=torch.int32), torch.ones(3), torch.ones(8)),
     "row_stats: expected 4"),
    (lambda: int8_mm_dequant(torch.ones(4, 8, dtype=torch.int32), torch.ones(4), torch.ones(8, dtype=torch.half)),
     "col_stats: expected dtype"),
    (lambda: matmul_8bit(torch.ones(4, 8), torch.ones(3, 7, dtype=torch.int8), torch.ones(3)), r"CB: expected"),
    (lambda: matmul_8bit(torch.ones(4, 8), torch.ones(3, 8, dtype=torch.int8), torch.ones(2)), "SCB: expected 3"),
    (lambda: matmul_8bit(torch.ones(4, 8), torch.ones(3, 8, dtype=torch.int8), torch.ones(3), bias=torch.ones(4)),
     "bias: expected 3"),
    (lambda: matmul_8bit(torch.ones(4, 8), torch.ones(3, 8, dtype=torch.int8), torch.ones(3), threshold=-2),
     "threshold: expected"),
])
def test_functional_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -- Int8Params / Linear8bitLt -------------------------------------------------------------------------


def _params(fn, skip=("self", "cls", "kwargs", "args")):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in skip]


def test_constructors_match_bitsandbytes():
    assert _params(Int8Params.__new__) == _params(bnb.nn.Int8Params.__new__)
    assert _params(Linear8bitLt.__init__) == _params(bnb.nn.Linear8bitLt.__init__)
    layer = Linear8bitLt(IN, OUT)
    assert layer.weight.has_fp16_weights and layer.weight.requires_grad and layer.state.threshold == 0.0
    assert isinstance(layer.weight, Int8Params) and layer.weight.CB is None and layer.weight.SCB is None
    assert layer.state.CB is None and layer.state.SCB is None and layer.state.has_fp16_weights


def test_state_view_follows_the_weight():
    _, ours, theirs = int8_pair(6.0)
    state = ours.state
    assert state.threshold == 6.0 and not state.has_fp16_weights and not state.is_training
    assert state.SCB is ours.weight.SCB and state.CB.data_ptr() == ours.weight.data_ptr()
    state.threshold = 3.0
    assert ours.threshold == 3.0
    assert sorted(n for n in ("threshold", "has_fp16_weights", "is_training", "CB", "SCB")
                  if hasattr(theirs.state, n)) == sorted(("threshold", "has_fp16_weights", "is_training", "CB", "SCB"))


def fp16_linear(bias=True):
    linear = nn.Linear(IN, OUT, bias=bias).half()
    return linear


def int8_pair(threshold=0.0, bias=True, source=None):
    """(ours, bitsandbytes') inference Linear8bitLt with the same weights, quantized the documented way."""
    source = source or fp16_linear(bias)
    layers = []
    for cls in (Linear8bitLt, bnb.nn.Linear8bitLt):
        layer = cls(IN, OUT, bias=bias, has_fp16_weights=False, threshold=threshold)
        layer.load_state_dict(source.state_dict())
        layers.append(layer.to("cpu").eval())  # eval: bitsandbytes' CPU training path is another algorithm
    return source, *layers


@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_linear8bitlt_matches_bitsandbytes(threshold):
    source, ours, theirs = int8_pair(threshold)
    assert ours.weight.dtype == torch.int8 and torch.equal(ours.weight.data, theirs.weight.data)
    assert same_bits(ours.weight.SCB, theirs.weight.SCB) and ours.weight.CB.data_ptr() == ours.weight.data_ptr()
    x = torch.randn(2, 16, IN, dtype=torch.float16)
    x[:, ::4, 5] = 9.0
    with torch.no_grad():
        y, y_bnb = ours(x), theirs(x)
    torch.testing.assert_close(y.float(), y_bnb.float(), atol=2e-3, rtol=2e-3)
    if threshold:
        torch.testing.assert_close(y, source(x), atol=0.03, rtol=0.05)  # test_linear8bitlt's fp16 tolerance


def test_linear8bitlt_gradients_reach_input_and_bias():
    source, ours, theirs = int8_pair(6.0)
    x = torch.randn(8, IN, dtype=torch.float16, requires_grad=True)
    ours(x).float().pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    source(x_ref).float().pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=0.01 * 8, rtol=0.05)  # grads of ~8: 0.01 relative
    assert ours.bias.grad is not None and not ours.weight.requires_grad and ours.weight.grad is None


def test_has_fp16_weights_layer_trains_its_weight():
    layer = Linear8bitLt(IN, OUT, has_fp16_weights=True, threshold=6.0)
    x = torch.randn(8, IN)
    layer(x).sum().backward()
    assert layer.weight.dtype == torch.float32 and layer.weight.grad is not None
    torch.testing.assert_close(layer.weight.grad, torch.ones(8, OUT).t() @ x)
    assert "SCB" not in layer.state_dict()  # nothing quantized to save


def test_state_dict_bitsandbytes_to_ours_and_back():
    source, _, theirs = int8_pair(6.0)
    saved = theirs.state_dict()
    assert sorted(saved) == ["SCB", "bias", "weight", "weight_format"]
    for target in (Linear8bitLt(IN, OUT, has_fp16_weights=False, threshold=6.0),  # not quantized yet: accepted
                   Linear8bitLt(IN, OUT, has_fp16_weights=False, threshold=6.0).to("cpu")):
        target.load_state_dict(saved)
        assert torch.equal(target.weight.data, theirs.weight.data) and same_bits(target.weight.SCB, theirs.weight.SCB)
        mine = target.state_dict()
        assert sorted(mine) == sorted(saved)
        assert mine["weight_format"].dtype == torch.uint8 and mine["weight_format"].item() == 0
        assert mine["weight"].data_ptr() != saved["weight"].data_ptr()  # copied, not aliased
    # ours -> bitsandbytes (which needs a quantized layer to load into)
    back = bnb.nn.Linear8bitLt(IN, OUT, has_fp16_weights=False, threshold=6.0).to("cpu").eval()
    back.load_state_dict(target.state_dict())
    x = torch.randn(4, IN, dtype=torch.float16)
    with torch.no_grad():
        torch.testing.assert_close(back(x).float(), target.eval()(x).float(), atol=2e-3, rtol=2e-3)
        assert same_bits(back.state.SCB, target.weight.SCB)  # bitsandbytes moved it to its state in forward


def test_state_dict_round_trip_through_safetensors(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    _, ours, _ = int8_pair()
    path = tmp_path / "int8.safetensors"
    safetensors.save_file(ours.state_dict(), path)
    loaded = Linear8bitLt(IN, OUT, has_fp16_weights=False)
    loaded.load_state_dict(safetensors.load_file(path))
    x = torch.randn(4, IN, dtype=torch.float16)
    assert same_bits(loaded(x), ours(x))


def test_full_precision_checkpoint_into_quantized_layer_is_quantized():
    source, ours, theirs = int8_pair()
    other = fp16_linear()
    ours.load_state_dict(other.state_dict())
    expected, expected_scb, _ = int8_vectorwise_quant(other.weight.detach())
    assert torch.equal(ours.weight.data, expected) and same_bits(ours.weight.SCB, expected_scb)


@pytest.mark.parametrize("legacy", [1, 2, 3])
def test_legacy_weight_formats_are_rejected(legacy):
    _, ours, _ = int8_pair()
    saved = ours.state_dict()
    saved["weight_format"] = torch.tensor(legacy, dtype=torch.uint8)
    with pytest.raises(ValueError, match="weight_format: only the row-major int8 format"):
        Linear8bitLt(IN, OUT, has_fp16_weights=False).load_state_dict(saved)


def test_incomplete_int8_checkpoints_are_errors():
    _, ours, _ = int8_pair()
    saved = ours.state_dict()
    without_scb = {k: v for k, v in saved.items() if k != "SCB"}
    with pytest.raises(RuntimeError, match="SCB: the checkpoint has an int8 weight but not its SCB"):
        Linear8bitLt(IN, OUT, has_fp16_weights=False).load_state_dict(without_scb)
    bad_shape = dict(saved, weight=saved["weight"][:, :-1])
    with pytest.raises(ValueError, match=r"state_dict: expected an int8 weight of shape \(40, 96\)"):
        Linear8bitLt(IN, OUT, has_fp16_weights=False).load_state_dict(bad_shape)


def test_int8params_rebuilds_from_its_dict_and_keeps_codes_through_casts():
    _, ours, _ = int8_pair()
    weight = ours.weight
    again = Int8Params(weight.data, requires_grad=False, **weight.__dict__)
    assert again.CB.data_ptr() == weight.data_ptr() and again.SCB is weight.SCB and not again.has_fp16_weights
    ours.half()
    ours.to(torch.bfloat16)
    assert ours.weight.dtype == torch.int8 and torch.equal(ours.weight.data, weight.data)
    with pytest.raises(ValueError, match="SCB: expected an fp32 tensor"):
        Int8Params(torch.ones(2, 2), SCB=torch.ones(2, dtype=torch.half))


def test_linear8bitlt_quantizes_on_first_forward_where_it_is():
    layer = Linear8bitLt(IN, OUT, has_fp16_weights=False)
    y = layer(torch.randn(3, IN))
    assert layer.weight.dtype == torch.int8 and y.shape == (3, OUT) and y.dtype == torch.float32
    with pytest.raises(ValueError, match="threshold: expected a number >= 0"):
        Linear8bitLt(IN, OUT, threshold=-1.0)


# -- quantize_model ---------------------------------------------------------------------------------------


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.lm_head = nn.Linear(IN, 128), nn.Linear(128, IN), nn.Linear(IN, 50)

    def forward(self, x):
        return self.lm_head(self.down(F.gelu(self.up(x))))


def test_quantize_model_int8():
    model = TinyMLP().half()
    x = torch.randn(4, IN, dtype=torch.float16)
    with torch.no_grad():
        expected = model(x)
    report = quantize_model(model, "int8", threshold=6.0, progress=False)
    assert report.replaced == ["up", "down"] and report.skipped == ["lm_head"] and report.quant_type == "int8"
    assert isinstance(model.up, Linear8bitLt) and model.up.weight.dtype == torch.int8 and model.up.threshold == 6.0
    assert report.ratio < 0.65  # int8 weights + fp32 SCB + fp16 biases vs fp16 weights, lm_head kept
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("kwargs, message", [
    ({"quant_type": "int8", "threshold": -1}, "threshold: expected a number >= 0"),
    ({"quant_type": "int8", "compute_dtype": torch.float16}, "compute_dtype: not used by quant_type='int8'"),
    ({"quant_type": "nf4", "threshold": 6.0}, "threshold: only used by quant_type='int8'"),
])
def test_quantize_model_int8_errors(kwargs, message):
    model = TinyMLP()
    with pytest.raises(ValueError, match=message):
        quantize_model(model, progress=False, **kwargs)
    assert not any(isinstance(m, Linear8bitLt) for m in model.modules())


def test_has_fp16_weights_forward_matches_bitsandbytes():
    source = fp16_linear()
    ours, theirs = Linear8bitLt(IN, OUT, threshold=6.0), bnb.nn.Linear8bitLt(IN, OUT, threshold=6.0)
    for layer in (ours, theirs):
        layer.load_state_dict(source.state_dict())
        layer.half().eval()
    theirs.weight.requires_grad_(False)  # else bitsandbytes takes int8_double_quant, which has no CPU kernel
    x = activations(8)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=2e-3, rtol=2e-3)
    assert ours.weight.dtype == torch.float16  # quantized per call, never stored


def test_deepcopy_move_and_meta_construction():
    import copy

    _, ours, _ = int8_pair()
    twin = copy.deepcopy(ours)
    assert isinstance(twin.weight, Int8Params) and torch.equal(twin.weight.data, ours.weight.data)
    assert twin.weight.SCB is not ours.weight.SCB and same_bits(twin.weight.SCB, ours.weight.SCB)
    moved = twin.to("cpu")
    assert moved.weight.dtype == torch.int8 and moved.weight.SCB is not None
    # built on meta (no memory), then a checkpoint assigned: what loaders such as transformers do
    empty = Linear8bitLt(IN, OUT, has_fp16_weights=False, device="meta")
    empty.load_state_dict(ours.state_dict(), assign=True)
    x = torch.randn(4, IN, dtype=torch.float16)
    assert not empty.weight.is_meta and same_bits(empty(x), ours(x))
    with pytest.raises(ValueError, match="weight: on the meta device"):
        Linear8bitLt(IN, OUT, has_fp16_weights=False, device="meta")(x)
