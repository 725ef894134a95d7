"""``build_model(quantize=...)`` quantizes each projection as soon as it is loaded (``models/quantize_at_load.py``):
the same model, bit for bit, as loading in full precision and quantizing after (``quantize_model``, and the packed
GGUF layers on the CPU), while no more than a couple of full-precision projection weights ever exist at once;
refusals come before any weight is read, and a bad checkpoint is the same error as without quantize."""

import dataclasses
import gc
import warnings

import pytest
import torch

from anygpu.bench.model import random_config
from anygpu.models import gguf_packed
from anygpu.models.llama import LlamaForCausalLM
from anygpu.models.parallel import TensorParallel
from anygpu.models.quantize_at_load import plan
from anygpu.models.quantize_packed import pack_linear, packed_types
from anygpu.models.registry import build_model, random_weights
from anygpu.nn.linear_gguf_8bit import GGUF8bitLinear
from anygpu.nn.quantize_model import quantize_model

from ._staging import force_staging

TYPES = ("nf4", "fp4", "int8", "q4_0", "q4_k", "q8_0")
GGUF_TYPES = ("q4_0", "q4_k", "q8_0")
TINY = random_config("tiny")
# Biases on q/k/v, a tied head, inputs of 288 (q4_k falls back to Q8_0 there) and a vocab that pads under tp=2.
ODD = dataclasses.replace(TINY, hidden_size=288, vocab_size=1001, attention_bias=True, tie_word_embeddings=True)


def _swap(model, name, layer):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)


def _quantized_after_loading(config, quant_type, **kwargs):
    """What build_model made before it quantized at load: the full-precision model, then its quantizers."""
    model = build_model(config, "random", progress=False, **kwargs)
    world_size = kwargs["tp"].world_size if "tp" in kwargs else 1
    if quant_type in GGUF_TYPES and gguf_packed.enabled(torch.device("cpu"), world_size):
        packed, left = packed_types(model, quant_type)
        for name, kind in packed.items():
            _swap(model, name, pack_linear(model.get_submodule(name), kind))
        if packed and not left:
            return model
    quantize_model(model, quant_type, progress=False, **({"threshold": 6.0} if quant_type == "int8" else {}))
    return model


def assert_same_model(got, want):
    assert {n: type(m) for n, m in got.named_modules()} == {n: type(m) for n, m in want.named_modules()}
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _build_both(config, quant_type, **kwargs):
    with warnings.catch_warnings(record=True) as at_load:
        warnings.simplefilter("always")
        got = build_model(config, "random", progress=False, quantize=quant_type, **kwargs)
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        want = _quantized_after_loading(config, quant_type, **kwargs)
    assert [str(w.message) for w in at_load] == [str(w.message) for w in after]  # q4_k's fallback warnings
    return got, want


@pytest.mark.parametrize("config", [TINY, ODD], ids=["tiny", "odd"])
@pytest.mark.parametrize("quant_type,packed", [(q, "0") for q in TYPES] + [(q, "1") for q in GGUF_TYPES])
def test_quantizing_at_load_is_bit_for_bit_quantizing_after(quant_type, packed, config, monkeypatch):
    """ANYGPU_CPU_GGUF_PACKED=1: the GGUF types' packed CPU layers (the suite's default is 0)."""
    monkeypatch.setenv("ANYGPU_CPU_GGUF_PACKED", packed)
    got, want = _build_both(config, quant_type)
    assert_same_model(got, want)
    if config is ODD and quant_type == "q4_k" and packed == "0":
        assert {type(m).__name__ for m in got.layers[0].self_attn.modules()} >= {"GGUF8bitLinear", "GGUF4bitLinear"}


@pytest.mark.parametrize("quant_type", ["nf4", "int8", "q8_0"])
def test_tensor_parallel_shards_and_bf16_are_quantized_alike(quant_type):
    for rank in (0, 1):
        got, want = _build_both(ODD, quant_type, dtype=torch.bfloat16, tp=TensorParallel(rank, 2))
        assert_same_model(got, want)
        assert got.shard.vocab_real == 501 - rank and not got.lm_head.weight[got.shard.vocab_real:].any()  # padding


@pytest.mark.parametrize("rank", [0, 1])
def test_a_gpu_plan_quantizes_the_head_as_it_loads(rank):
    """The GGUF types' head on a GPU (``GGUF_HEAD_TYPES``), planned for cuda and loaded on the CPU: a tied head
    under tp=2 is its rank's own copy, padded, and is quantized too."""
    tp = TensorParallel(rank, 2)
    model = LlamaForCausalLM(ODD, device="meta", tp=tp)
    layers = plan(model, "q4_0", torch.device("cuda"), tp.world_size)
    assert layers["lm_head"].kind == "Q8_0"  # 288 inputs: not whole 256-blocks, so not Q6_K
    model.allocate("cpu", lazy=layers)
    model.load_weights(random_weights(ODD), replace={name: q.make for name, q in layers.items()})
    want = build_model(ODD, "random", progress=False, tp=tp)
    quantize_model(want, "q4_0", progress=False)
    want.lm_head = GGUF8bitLinear.from_linear(want.lm_head, "Q8_0")
    assert_same_model(model, want)


def _live_projection_weights(shapes) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.nn.Parameter and o.is_floating_point()
               and not o.is_meta and tuple(o.shape) in shapes)


@pytest.mark.parametrize("quant_type,packed", [("nf4", "0"), ("int8", "0"), ("q4_k", "0"), ("q4_0", "1")])
def test_full_precision_projections_never_all_exist(quant_type, packed, monkeypatch):
    """Counted at every tensor the checkpoint hands over: live full-precision projection weights (quantizing
    after loading holds all 4 * num_layers of them here, before the first tensor is read)."""
    monkeypatch.setenv("ANYGPU_CPU_GGUF_PACKED", packed)
    config = dataclasses.replace(TINY, vocab_size=1000, num_layers=3)
    meta = LlamaForCausalLM(config, device="meta")
    shapes = {tuple(m.weight.shape) for n, m in meta.named_modules() if n.endswith("_proj")}
    assert not shapes & {tuple(meta.lm_head.weight.shape)} and len(shapes) == 4
    counts = []

    def watched():
        for item in random_weights(config):
            counts.append(_live_projection_weights(shapes))
            yield item

    model = build_model(config, watched(), progress=False, quantize=quant_type)
    assert max(counts) <= 2 and _live_projection_weights(shapes) == 0, counts
    assert all(type(m) is not torch.nn.Linear for n, m in model.named_modules() if n.endswith("_proj"))


@pytest.mark.parametrize("quant_type,packed", [("q8_0", "0"), ("q4_0", "1"), ("q4_k", "1")])
def test_a_layer_no_block_fits_is_refused_before_any_weight_is_read(quant_type, packed, monkeypatch):
    monkeypatch.setenv("ANYGPU_CPU_GGUF_PACKED", packed)
    config = dataclasses.replace(TINY, intermediate_size=40)  # down_proj: 40 inputs
    started = []

    def weights():
        started.append(True)
        yield from random_weights(config)

    with pytest.raises(ValueError, match=r"needs in_features a multiple of 32.*down_proj \(40\)"):
        build_model(config, weights(), progress=False, quantize=quant_type)
    assert not started


def _edited(drop=None, reshape=None, add=None, repeat=None):
    for name, tensor in random_weights(TINY):
        if name == drop:
            continue
        if name == reshape:
            tensor = tensor[:-1]
        yield name, tensor
        if name == repeat:
            yield name, tensor
    if add:
        yield add, torch.zeros(4)


BAD = {"missing": (dict(drop="model.layers.1.self_attn.v_proj.weight"), "qkv_proj.weight rows"),
       "shape": (dict(reshape="model.layers.0.mlp.up_proj.weight"), "'model.layers.0.mlp.up_proj"),
       "unknown": (dict(add="model.layers.0.mlp.extra.weight"), "'model.layers.0.mlp.extra")}


@pytest.mark.parametrize("edit,named", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("quant_type", ["nf4", "q4_0"])
def test_a_bad_checkpoint_is_the_same_error_as_without_quantize(edit, named, quant_type):
    with pytest.raises(ValueError, match=named) as plain:
        build_model(TINY, _edited(**edit), progress=False)
    with pytest.raises(ValueError) as quantized:
        build_model(TINY, _edited(**edit), progress=False, quantize=quant_type)
    assert str(quantized.value) == str(plain.value)


def test_a_tensor_after_its_layer_was_quantized_is_an_error():
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' comes after layers.0.mlp.down_proj "
                                         r"was loaded whole and replaced"):
        build_model(TINY, _edited(repeat="model.layers.0.mlp.down_proj.weight"), progress=False, quantize="nf4")


def test_prepare_is_not_taken_with_quantize():
    with pytest.raises(ValueError, match="prepare: not with quantize="):
        build_model(TINY, "random", progress=False, quantize="nf4", prepare=lambda m: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("staged", [False, True], ids=["on-gpu", "staged"])
@pytest.mark.parametrize("quant_type", TYPES)
def test_a_gpu_build_is_quantizing_after(quant_type, staged, monkeypatch):
    """On a GPU: the same model, bit for bit, as loading in bf16 on the GPU and quantizing there (the GGUF types'
    head as ``plan`` chose it), whether the full-precision weights load on the GPU or, where it is too tight
    for one, into host memory (the 4-bit formats move a whole weight to quantize it: never staged)."""
    if staged:
        force_staging(monkeypatch, TINY, quant_type)
    kwargs = {"dtype": torch.bfloat16, "device": "cuda"}
    got = build_model(TINY, "random", progress=False, quantize=quant_type, **kwargs)
    assert got._staging.type == ("cpu" if staged and quant_type not in ("nf4", "fp4") else "cuda")
    monkeypatch.undo()
    want = _quantized_after_loading(TINY, quant_type, **kwargs)
    head = plan(LlamaForCausalLM(TINY, device="meta"), quant_type, torch.device("cuda")).get("lm_head")
    if head is not None:
        want.lm_head = GGUF8bitLinear.from_linear(want.lm_head, head.kind)
    assert all(t.device.type == "cuda" for t in [*got.parameters(), *got.buffers()])
    assert_same_model(got, want)
