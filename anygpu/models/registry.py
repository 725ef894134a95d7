"""From a checkpoint (or a bare config) to a ready model: architecture lookup, weights, quantization.

``build_model(config, weights=..., dtype=..., device=..., quantize=...)``: the model class comes from
``ARCHITECTURES`` (one entry per supported ``ModelConfig.architecture``); weights are a checkpoint's
``weights()`` iterator or ``"random"`` (vLLM's dummy weights: uniform in [-1e-3, 1e-3], norms at 1, for
benchmarks in real shapes without a download).  ``quantize`` quantizes every linear but the output head as
``anygpu.nn.quantize_model`` would (nf4, fp4, int8 = LLM.int8() at threshold 6.0, q4_0 / q4_k / q8_0 = GGUF blocks;
on the CPU the GGUF types packed: ``quantize_packed.py``), each as soon as it is loaded (``quantize_at_load.py``),
with a progress bar: the model is built on the meta device, the layers to quantize are planned there (and the
plan's refusals raised) before any weight is read, and the model must fit quantized, not in full precision.  The
GGUF types also quantize an untied head on a GPU, to the type llama.cpp's mixes give it
(``quantize_at_load.GGUF_HEAD_TYPES``), so the model reads per step what a llama.cpp file of that type would.  A
bitsandbytes checkpoint (``config.quantization``) is not re-quantized: its stored layers load as they are
(``bnb_load.py``).

``tp``: build one rank's shard of a tensor-parallel model.  Random weights are generated as full HF-named
tensors, each from a seed derived from its name, and go through ``load_weights`` like a checkpoint's: every
rank cuts its shard out of the same full tensors, so a model is the same whatever the number of ranks (and
TP=2 can be checked against TP=1 on a random model).  Quantizing quantizes each rank's shards.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from .._progress import disabled
from . import quantize_at_load, quantized_size
from .bnb_load import build_prequantized
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import LlamaForCausalLM
from .memory_check import check_model_fits
from .parallel import TensorParallel
from .shape_check import expected_shapes

# Every family shares one implementation: what each changes is declared in families.py and read from the config
# (a Family's switches, ModelConfig's values), not coded per class.
ARCHITECTURES = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
# q4_*, q8_0: GGUF blocks (nn.GGUF4bitLinear, nn.GGUF8bitLinear)
QUANT_TYPES = ("nf4", "fp4", "int8", "q4_0", "q4_k", "q8_0")


def model_class(config: ModelConfig):
    try:
        return ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(f"architecture: {config.architecture!r} is not supported; expected one of "
                         f"{sorted(ARCHITECTURES)}") from None


def random_weights(config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   seed: int = 1234, scale: float = 1e-3) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors of a Llama-family model: norms at 1, everything else uniform in [-scale, scale].
    Each tensor has its own generator, seeded from ``seed`` and a CRC of its name (stable across processes,
    unlike ``hash``), so it does not depend on which tensors a rank keeps or in what order they are made.
    Made on ``device`` in ``dtype``, one at a time: an 8B model takes well under a second on a GPU."""
    shapes = {name: shape for name, (shape, _) in expected_shapes(config).items()}
    device = torch.device(device)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):  # norms that scale by 1 (Gemma's store weight - 1)
            yield name, torch.full(shape, 1.0 - config.family.norm_offset, dtype=dtype, device=device)
            continue
        gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))
        yield name, torch.empty(shape, dtype=dtype, device=device).uniform_(-scale, scale, generator=gen)


def build_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]] | str,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                quantize: str | None = None, progress: bool = True,
                tp: TensorParallel | None = None, max_position: int | None = None,
                prepare: Callable[[torch.nn.Module], object] | None = None) -> LlamaForCausalLM:
    """``max_position``: the longest context to run (sizes the rotary table; None: the config's).  ``prepare``:
    called with the model before the weights are copied in (its weights are not yet written, so not yet in
    memory): swapping layers there means ``weights`` need not hold theirs (``models/gguf_packed.py``)."""
    if quantize is not None and quantize not in QUANT_TYPES:
        raise ValueError(f"quantize: expected one of {QUANT_TYPES} or None, got {quantize!r}")
    if isinstance(weights, str):
        if weights != "random":
            raise ValueError(f"weights: expected a (name, tensor) iterator or 'random', got {weights!r}")
        weights = random_weights(config, dtype, device)
    if config.quantization is not None:
        if config.family.fused_checkpoint:
            raise ValueError(f"quantization_config: a bitsandbytes {config.architecture} checkpoint stores qkv_proj "
                             "and gate_up_proj fused, which this loader does not split; load the unquantized model "
                             "with quantize='nf4' (or 'fp4', 'int8') instead")
        if quantize is not None:
            raise ValueError(f"quantize: the checkpoint is already quantized by bitsandbytes "
                             f"({config.quantization.bits}-bit); load it without quantize={quantize!r}")
        where = getattr(weights, "where", "the checkpoint")  # HFCheckpoint.weights() says which folder
        return build_prequantized(model_class(config), config, weights, dtype, device, tp, max_position, where)
    if quantize is not None:
        if prepare is not None:
            raise ValueError("prepare: not with quantize= (prepare swaps layers for a file's own quantized ones; "
                             "quantize= quantizes the layers as they load)")
        return _build_quantized(config, weights, dtype, torch.device(device), quantize, progress, tp, max_position)
    model = model_class(config)(config, dtype=dtype, device=device, tp=tp, max_position=max_position)
    if prepare is not None:
        prepare(model)
    model.load_weights(weights)
    return model.eval()


def _build_quantized(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     device: torch.device, quantize: str, progress: bool, tp: TensorParallel | None,
                     max_position: int | None) -> LlamaForCausalLM:
    """The model built on meta, its layers planned (``quantize_at_load.plan``: refusals raised before any weight
    is read) and checked to fit quantized with one projection being quantized (``quantized_size``), then loaded
    with each planned layer's weight allocated at its first write (in host memory where the GPU is too tight
    for one beside the model) and quantized once all its rows are in.  An error on the way leaves no model to
    anyone."""
    model = model_class(config)(config, dtype=dtype, device="meta", tp=tp, max_position=max_position)
    gpu = device.type != "cpu"
    layers = quantize_at_load.plan(model, quantize, device, tp.world_size if tp else 1, to=device if gpu else None)
    kinds = {name: q.kind for name, q in layers.items()}
    loaded, staging = quantized_size.loaded_bytes(model, kinds), None
    try:
        check_model_fits(config, loaded, model.max_position, device,
                         transient=quantized_size.transient_bytes(model, kinds, device))
    except ValueError:
        if not gpu:
            raise
        # Too tight for a full-precision projection beside the model: load those into host memory and quantize
        # them onto the GPU a slice of rows at a time (bitsandbytes' way; slower, the weights cross twice).
        check_model_fits(config, loaded, model.max_position, device,
                         transient=quantized_size.transient_bytes(model, kinds, device, staged=True))
        staging = torch.device("cpu")
    model.allocate(device, lazy=layers, staging=staging)
    with tqdm(total=len(layers), desc=f"quantize {quantize}", unit="layer", disable=disabled(progress)) as bar:
        model.load_weights(weights, replace={name: _counted(q.make, bar) for name, q in layers.items()})
    return model.eval()


def _counted(make: Callable[[nn.Module], nn.Module], bar) -> Callable[[nn.Module], nn.Module]:
    def counted(module: nn.Module) -> nn.Module:
        layer = make(module)
        bar.update()
        return layer
    return counted
