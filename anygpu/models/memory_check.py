"""Will a model fit?  Asked before its weights and rotary table are allocated, so a config that sizes them too big
is a ValueError naming the field instead of an allocator traceback or the machine swapping.

    check_model_fits(config, param_bytes=..., max_position=4096, device=torch.device("cpu"))

Free memory: CUDA's ``mem_get_info`` on a GPU; ``MemAvailable`` of /proc/meminfo (what the kernel can hand out
without swapping) on the CPU, else the free physical pages.  Other devices (meta, mps...) are not checked.
"""

from __future__ import annotations

import os

import torch

# Building the fp32 [positions, head_dim] table goes through float64 angles, their cos and sin and the
# concatenation (rotary_cos_sin_cache): about 24 bytes per table element at the peak, 4 kept.
ROTARY_PEAK_BYTES_PER_ELEMENT = 24


def available_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``, or None where this is not known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def check_model_fits(config, param_bytes: int, max_position: int, device: torch.device,
                     free: int | None = None, transient: int = 0) -> None:
    """ValueError naming the field(s) when the weights (``param_bytes``, plus ``transient`` held for a while on
    the way: a layer being quantized) plus the rotary table for ``max_position`` positions cannot fit in what
    ``device`` has free (``free``: that number, when known)."""
    free = available_bytes(device) if free is None else free
    if free is None:
        return
    rotary = max_position * config.head_dim * ROTARY_PEAK_BYTES_PER_ELEMENT
    if rotary + param_bytes + transient <= free:
        return
    if rotary > free // 2:  # the table is the problem, not the weights
        raise ValueError(f"max_position: the rotary table for {max_position} positions (head_dim {config.head_dim}) "
                         f"needs {_gib(rotary)} while it is built, and the weights {_gib(param_bytes + transient)}, "
                         f"but {device} has {_gib(free)} free; serve a shorter context (max_model_len) or fix "
                         "max_position_embeddings")
    c = config
    during = f" (and {_gib(transient)} more while a layer is quantized)" if transient else ""
    raise ValueError(f"the weights need {_gib(param_bytes)}{during} (num_layers {c.num_layers}, hidden_size "
                     f"{c.hidden_size}, intermediate_size {c.intermediate_size}, vocab_size {c.vocab_size}) and the "
                     f"rotary table {_gib(rotary)}, but {device} has {_gib(free)} free; use a smaller model or dtype, "
                     "more GPUs (tensor parallelism) or free memory")
