"""From a checkpoint (or a bare config) to a ready model: architecture lookup, weights, quantization.

``build_model(config, weights=..., dtype=..., device=..., quantize=...)``: the model class comes from
``ARCHITECTURES`` (one entry per supported ``ModelConfig.architecture``); weights are a checkpoint's
``weights()`` iterator or ``"random"`` (vLLM's dummy weights: uniform in [-1e-3, 1e-3] from a fixed seed, norms
at 1, for benchmarks in real shapes without a download).  ``quantize`` re-quantizes every linear but the
output head with ``anygpu.nn.quantize_model`` (nf4, fp4, int8 = LLM.int8() at threshold 6.0), with a
progress bar.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..nn import quantize_model
from .config import ModelConfig
from .llama import LlamaForCausalLM

# The Llama family shares one implementation: Mistral adds a sliding window, Qwen2 q/k/v biases, both
# read from the config.
ARCHITECTURES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}
QUANT_TYPES = ("nf4", "fp4", "int8")


def model_class(config: ModelConfig):
    try:
        return ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(f"architecture: {config.architecture!r} is not supported; expected one of "
                         f"{sorted(ARCHITECTURES)}") from None


@torch.no_grad()
def random_weights_(model: torch.nn.Module, seed: int = 1234, scale: float = 1e-3) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-scale, scale, generator=gen)


def build_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]] | str,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                quantize: str | None = None, progress: bool = True) -> LlamaForCausalLM:
    if quantize is not None and quantize not in QUANT_TYPES:
        raise ValueError(f"quantize: expected one of {QUANT_TYPES} or None, got {quantize!r}")
    model = model_class(config)(config, dtype=dtype, device=device)
    if isinstance(weights, str):
        if weights != "random":
            raise ValueError(f"weights: expected a (name, tensor) iterator or 'random', got {weights!r}")
        random_weights_(model)
    else:
        model.load_weights(weights)
    if quantize is not None:
        # int8 is LLM.int8() with transformers' outlier threshold: activations' outlier columns stay in 16 bits.
        extra = {"threshold": 6.0} if quantize == "int8" else {}
        quantize_model(model, quantize, progress=progress, **extra)
    return model.eval()
