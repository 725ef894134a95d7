"""Quantizing a slice of rows at a time (``anygpu/ops/row_slices.py``) gives the bytes of quantizing the whole
weight, for every quantizer that slices (GGUF blocks, LLM.int8()'s rows, the CPU's NF4 / FP4 reference and the
layers built on them); and the memory check counts what quantizing at load holds on the way
(``models/quantized_size.py``), refusing with a clear error a model that fits only once quantized."""

import sys

import pytest
import torch
from torch import nn

from anygpu.bench.model import random_config
from anygpu.models import memory_check, quantized_size
from anygpu.models.llama import LlamaForCausalLM
from anygpu.models.quantize_at_load import plan
from anygpu.models.quantize_packed import pack_linear
from anygpu.models.registry import build_model, random_weights
from anygpu.nn.linear8bit import Linear8bitLt
from anygpu.nn.linear_gguf_4bit import GGUF4bitLinear
from anygpu.nn.linear_gguf_8bit import GGUF8bitLinear
from anygpu.ops import row_slices
from anygpu.ops.row_slices import by_rows
from anygpu.quant import gguf_4bit, gguf_8bit
from anygpu.quant.int8 import int8_vectorwise_quant

from ._staging import force_staging

quantize_4bit_module = sys.modules["anygpu.ops.quantize_4bit"]  # (the package's name is the op)
TINY = random_config("tiny")


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of at most 1000 weights: a few rows each, a ragged last one."""
    monkeypatch.setattr(row_slices, "SLICE_ELEMENTS", 1000)


def _same(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif a is None:
        assert b is None
    else:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("quantize,k", [(gguf_4bit.quantize_q4_0, 96), (gguf_4bit.quantize_q4_k, 256),
                                        (gguf_8bit.quantize_q8_0, 96), (gguf_8bit.quantize_q6_k, 256),
                                        (lambda w: int8_vectorwise_quant(w.half()), 96)],
                         ids=["q4_0", "q4_k", "q8_0", "q6_k", "int8"])
def test_by_rows_is_the_whole_quantizer(quantize, k):
    w = torch.randn(53, k) * 3
    whole = quantize(w)
    row_slices.SLICE_ELEMENTS, saved = 4 * k + 1, row_slices.SLICE_ELEMENTS  # 4 rows a slice, a ragged 53rd
    try:
        _same(by_rows(quantize, w), whole)
    finally:
        row_slices.SLICE_ELEMENTS = saved


def test_a_quantizer_whose_output_is_not_per_row_is_refused(small_slices):
    with pytest.raises(RuntimeError, match="one row per input row"):
        by_rows(lambda rows: gguf_8bit.quantize_q8_0(rows).reshape(-1), torch.randn(100, 64))


@pytest.mark.parametrize("shape", [(40, 64), (777, 64), (4095,), (513, 66)])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16, torch.float32])
def test_the_4bit_reference_in_slices_is_the_same_bytes(shape, quant_type, storage, monkeypatch):
    a = torch.randn(*shape)
    if (a.numel() + 1) // 2 % storage.itemsize:
        pytest.skip("the packed bytes do not fill whole storage words")
    whole = quantize_4bit_module.reference(a, 64, quant_type, storage)
    monkeypatch.setattr(row_slices, "SLICE_ELEMENTS", 300)  # (rounded to whole blocks and words: 320)
    sliced = quantize_4bit_module.reference(a, 64, quant_type, storage)
    _same(tuple(t.view(torch.uint8) if t.dtype == storage else t for t in sliced),
          tuple(t.view(torch.uint8) if t.dtype == storage else t for t in whole))


def _layers(linear):
    return {"q4_0": GGUF4bitLinear.from_linear(linear, "Q4_0"), "q4_k": GGUF4bitLinear.from_linear(linear, "Q4_K"),
            "Q8_0": GGUF8bitLinear.from_linear(linear, "Q8_0"), "Q6_K": GGUF8bitLinear.from_linear(linear, "Q6_K"),
            "int8": Linear8bitLt.from_linear(linear, threshold=6.0),
            "packed q4_k": pack_linear(linear, "q4_k"), "packed q8_0": pack_linear(linear, "q8_0")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_quantized_in_slices_are_the_same(dtype, monkeypatch):
    torch.manual_seed(0)
    linear = nn.Linear(256, 48, dtype=dtype)  # (the CPU int4 layout takes whole 16-row groups)
    if dtype == torch.float32:  # (the packed CPU layers take fp32 weights)
        whole = _layers(linear)
    else:
        whole = {k: v for k, v in _layers(linear).items() if not k.startswith("packed")}
    monkeypatch.setattr(row_slices, "SLICE_ELEMENTS", 256 * 5)
    sliced = _layers(linear)
    for name, layer in whole.items():
        a, b = layer.state_dict(), sliced[name].state_dict()
        assert a.keys() == b.keys(), name
        for key in a:
            _same(a[key], b[key])


def _kinds(config, quant_type):
    model = LlamaForCausalLM(config, device="meta")
    return model, {name: q.kind for name, q in plan(model, quant_type, torch.device("cpu")).items()}


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "q4_k", "q8_0"])
def test_the_memory_check_counts_the_layer_being_quantized(quant_type, monkeypatch):
    """Free memory faked between the quantized model's bytes and those plus the largest layer's transient: refused
    with the check's error (naming both) before anything is read; with the transient free, it loads."""
    model, kinds = _kinds(TINY, quant_type)
    loaded = quantized_size.loaded_bytes(model, kinds)
    transient = quantized_size.transient_bytes(model, kinds, torch.device("cpu"))
    rotary = model.max_position * TINY.head_dim * memory_check.ROTARY_PEAK_BYTES_PER_ELEMENT
    assert transient > max(model.get_submodule(n).weight.numel() * 4 for n in kinds)  # at least its fp32 weight
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: loaded + rotary + transient - 1)
    with pytest.raises(ValueError, match="more while a layer is quantized.*free"):
        build_model(TINY, "random", progress=False, quantize=quant_type)
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: loaded + rotary + transient)
    build_model(TINY, "random", progress=False, quantize=quant_type)


def test_a_bitsandbytes_layer_counts_its_stored_bytes():
    """nf4 / fp4: 4 bits and an fp32 absmax per 64; int8: a byte and an fp32 scale per row (exact without double
    quant)."""
    model, _ = _kinds(TINY, "nf4")
    name = "layers.0.mlp.down_proj"
    w = model.get_submodule(name).weight
    dense = quantized_size.loaded_bytes(model, {})
    assert dense == sum(p.numel() * p.element_size() for p in model.parameters())
    for kind, size in (("nf4", w.numel() // 2 + w.numel() // 64 * 4), ("int8", w.numel() + w.shape[0] * 4)):
        got = quantized_size.loaded_bytes(model, {name: kind})
        assert got == dense - w.numel() * w.element_size() + size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("staged", [False, True], ids=["on-gpu", "staged"])
@pytest.mark.parametrize("quant_type", ["nf4", "int8", "q4_k", "q8_0"])
def test_a_gpu_build_stays_within_what_the_check_counts(quant_type, staged, monkeypatch):
    """The GPU peak of a real build (2 layers of 8B-sized projections and the 8B head; the checkpoint's tensors
    come from the host, as a file's do) stays within the quantized bytes plus the counted transient, with the
    full-precision weights on the GPU or (GPU memory faked too tight for them) staged on the host."""
    import dataclasses

    config = dataclasses.replace(random_config("llama3-8b"), num_layers=2)
    meta = LlamaForCausalLM(config, dtype=torch.bfloat16, device="meta", max_position=4096)
    cuda = torch.device("cuda")
    kinds = {n: q.kind for n, q in plan(meta, quant_type, cuda, to=cuda).items()}
    counted = (quantized_size.loaded_bytes(meta, kinds)
               + quantized_size.transient_bytes(meta, kinds, cuda, staged=staged))
    if staged:
        force_staging(monkeypatch, config, quant_type, max_position=4096)
    weights = random_weights(config, dtype=torch.bfloat16)  # (made on the host)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(config, weights, dtype=torch.bfloat16, device="cuda", quantize=quant_type, progress=False,
                        max_position=4096)
    peak = torch.cuda.max_memory_allocated() - base
    assert all(t.device.type == "cuda" for t in [*model.parameters(), *model.buffers()])
    del model
    assert peak <= counted + (64 << 20), (peak / 2**30, counted / 2**30)  # (the rotary table, small buffers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q8_0", "Q6_K"])
def test_the_gguf_layers_hold_what_convert_makes_of_the_whole_weight(type_name, dtype, small_slices):
    """Quantized and laid out a slice at a time, narrowed to fp16 scales over the whole layer: the tensors the
    GGUF loader's ``convert`` makes of the whole raw blocks."""
    torch.manual_seed(1)
    linear = nn.Linear(256, 40, dtype=dtype)
    linear.weight.data[3] *= 1e-6  # a row of tiny scales: fp16 cannot hold them (the narrowing keeps fp32)
    half = dtype == torch.bfloat16
    if type_name in ("Q4_0", "Q4_K"):
        raw = {"Q4_0": gguf_4bit.quantize_q4_0, "Q4_K": gguf_4bit.quantize_q4_k}[type_name](linear.weight.detach())
        want = gguf_4bit.convert(raw.reshape(-1), type_name, 40, 256, half_scales=half)
        got = GGUF4bitLinear.from_linear(linear, type_name)
        pairs = [(got.packed, want.packed), (got.absmax, want.absmax), (got.offset, want.offset),
                 (got.code, want.code)]
    else:
        raw = {"Q8_0": gguf_8bit.quantize_q8_0, "Q6_K": gguf_8bit.quantize_q6_k}[type_name](linear.weight.detach())
        want = gguf_8bit.convert(raw.reshape(-1), type_name, 40, 256, half_scales=half)
        got = GGUF8bitLinear.from_linear(linear, type_name)
        pairs = [(got.codes, want.codes), (got.scale, want.scale), (got.offset, want.offset)]
    for a, b in pairs:
        _same(a, b)
