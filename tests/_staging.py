"""``force_staging``: fake a GPU's free memory so that ``build_model(quantize=...)`` must stage the full-precision
weights in host memory (``models/registry.py``: what it does when one projection cannot sit beside the model)."""

import torch

from anygpu.models import memory_check, quantized_size
from anygpu.models.llama import LlamaForCausalLM
from anygpu.models.quantize_at_load import plan


def force_staging(monkeypatch, config, quant_type, dtype=torch.bfloat16, max_position=None) -> None:
    """The GPU's free memory faked at what the model needs with its full-precision weights staged on the host:
    too little to hold one on the GPU (for the formats that quantize a slice at a time).  Other devices keep
    their real answer."""
    meta = LlamaForCausalLM(config, dtype=dtype, device="meta", max_position=max_position)
    cuda = torch.device("cuda")
    kinds = {n: q.kind for n, q in plan(meta, quant_type, cuda, to=cuda).items()}
    need = (meta.max_position * config.head_dim * memory_check.ROTARY_PEAK_BYTES_PER_ELEMENT
            + quantized_size.loaded_bytes(meta, kinds) + quantized_size.transient_bytes(meta, kinds, cuda, staged=True))
    real = memory_check.available_bytes
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: need if device.type == "cuda" else real(device))
