"""The checks every ``from_linear`` makes on the ``nn.Linear`` it quantizes."""

from __future__ import annotations

import torch
from torch import nn


def source_weight(linear, device) -> tuple[torch.Tensor, torch.device]:
    """``linear``'s weight (detached) and the device to quantize on (default: where the weight is)."""
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
    weight = linear.weight.detach()
    device = weight.device if device is None else torch.device(device)
    if device.type == "meta":
        raise ValueError("device: expected a real device to quantize on, got meta")
    return weight, device
