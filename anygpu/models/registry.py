"""From a checkpoint (or a bare config) to a ready model: architecture lookup, weights, quantization.

``build_model(config, weights=..., dtype=..., device=..., quantize=...)``: the model class comes from
``ARCHITECTURES`` (one entry per supported ``ModelConfig.architecture``); weights are a checkpoint's
``weights()`` iterator or ``"random"`` (vLLM's dummy weights: uniform in [-1e-3, 1e-3], norms at 1, for
benchmarks in real shapes without a download).  ``quantize`` re-quantizes every linear but the output head with
``anygpu.nn.quantize_model`` (nf4, fp4, int8 = LLM.int8() at threshold 6.0, q4_0 / q4_k / q8_0 = GGUF blocks),
with a progress bar.  The GGUF types also quantize an untied head on a GPU, to the type llama.cpp's mixes give
it (``GGUF_HEAD_TYPES``), so the model reads per step what a llama.cpp file of that type would.  A bitsandbytes
checkpoint (``config.quantization``) is not re-quantized: its stored layers load as they are (``bnb_load.py``).

``tp``: build one rank's shard of a tensor-parallel model.  Random weights are generated as full HF-named
tensors, each from a seed derived from its name, and go through ``load_weights`` like a checkpoint's: every
rank cuts its shard out of the same full tensors, so a model is the same whatever the number of ranks (and
TP=2 can be checked against TP=1 on a random model).  Quantizing after sharding quantizes each rank's shards.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator

import torch

from ..nn import quantize_model
from ..nn.linear_gguf_8bit import GGUF8bitLinear
from . import gguf_packed
from .bnb_load import build_prequantized
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import LlamaForCausalLM
from .parallel import TensorParallel
from .quantize_packed import QUANTIZERS, pack_quantized
from .shape_check import expected_shapes

# Every family shares one implementation: what each changes is declared in families.py and read from the config
# (a Family's switches, ModelConfig's values), not coded per class.
ARCHITECTURES = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
# q4_*, q8_0: GGUF blocks (nn.GGUF4bitLinear, nn.GGUF8bitLinear)
QUANT_TYPES = ("nf4", "fp4", "int8", "q4_0", "q4_k", "q8_0")
# The output head of a GGUF type's model, as llama.cpp's quantizer stores it: Q6_K in every mix below Q8_0 (Q8_0
# where a row is not whole 256-blocks), Q8_0 in a Q8_0 file.  bitsandbytes' types leave it alone, as transformers
# does.  A tied head (it reads the embedding's weight) and a CPU model (no packed int8-block kernel there: the
# reference would rebuild the head every step) keep theirs.
GGUF_HEAD_TYPES = {"q4_0": "Q6_K", "q4_k": "Q6_K", "q8_0": "Q8_0"}


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
    model = model_class(config)(config, dtype=dtype, device=device, tp=tp, max_position=max_position)
    if prepare is not None:
        prepare(model)
    model.load_weights(weights)
    if quantize is not None:
        # int8 is LLM.int8() with transformers' outlier threshold: activations' outlier columns stay in 16 bits.
        extra = {"threshold": 6.0} if quantize == "int8" else {}
        where, packed, left = torch.device(device), [], []
        if quantize in QUANTIZERS and where.type == "cpu" and gguf_packed.enabled(where, tp.world_size if tp else 1):
            # packed GGUFLinear layers, as a GGUF file loads on the CPU
            packed, left = pack_quantized(model, quantize)
        if not packed or left:  # (nothing packed: quantize_model quantizes, or names why it cannot)
            quantize_model(model, quantize, progress=progress, **extra)
        if quantize in GGUF_HEAD_TYPES and where.type != "cpu":
            quantize_head(model, GGUF_HEAD_TYPES[quantize])
    return model.eval()


def quantize_head(model: LlamaForCausalLM, type_name: str) -> bool:
    """``model.lm_head`` as a ``GGUF8bitLinear`` of ``type_name`` (Q6_K, or Q8_0 where a row is not whole
    256-blocks), unless tied to the embedding or its rows are not whole 32-blocks.  Returns whether it did."""
    head = model.lm_head
    if head.weight is model.embed_tokens.weight or head.in_features % 32:
        return False
    if type_name == "Q6_K" and head.in_features % 256:
        type_name = "Q8_0"
    model.lm_head = GGUF8bitLinear.from_linear(head, type_name)
    return True
