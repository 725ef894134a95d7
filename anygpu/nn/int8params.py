"""``Int8Params``: a weight that quantizes itself to row-wise int8 on its first move, as bitsandbytes' does.

- Built from a full-precision [N, K] tensor it stays full precision until a ``.to(device)`` / ``.cuda()``
  / ``.cpu()`` to a real device (the CPU included; never ``meta``).  Unless ``has_fp16_weights``, that
  move casts it to fp16 and quantizes it there: ``data`` becomes the int8 codes ``CB`` [N, K] and ``SCB``
  the fp32 row scales [N] (absmax / 127 per row is the step).  The move returns the same object, so
  ``nn.Module.to`` keeps it.
- Moving a quantized param moves ``SCB`` along (on the old object too, since ``nn.Module.to`` may keep
  it and take only the new data).  Casts never touch it: int8 is not a floating dtype, so ``model.half()``
  and ``model.to(torch.bfloat16)`` leave the codes alone.
- ``CB`` is the int8 data itself (a property: one tensor, never two copies out of sync); ``__dict__``
  holds ``has_fp16_weights`` and ``SCB``, so ``Int8Params(data, requires_grad=False, **old.__dict__)``
  rebuilds an equivalent param, as transformers does.
"""

from __future__ import annotations

import copy

import torch

from ..ops.row_slices import by_rows
from ..quant.int8 import int8_vectorwise_quant


class Int8Params(torch.nn.Parameter):
    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True, has_fp16_weights: bool = False,
                CB: torch.Tensor | None = None, SCB: torch.Tensor | None = None, **kwargs) -> Int8Params:
        if data is None:
            data = torch.empty(0) if CB is None else CB
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"data: expected a tensor (or None), got {type(data).__name__}")
        if CB is not None and CB is not data and not (isinstance(CB, torch.Tensor) and CB.dtype == torch.int8):
            raise ValueError(f"CB: expected the int8 codes (or None), got {getattr(CB, 'dtype', type(CB).__name__)}")
        if SCB is not None and (not isinstance(SCB, torch.Tensor) or SCB.dtype != torch.float32):
            raise ValueError(f"SCB: expected an fp32 tensor of row scales (or None), got "
                             f"{getattr(SCB, 'dtype', type(SCB).__name__)}")
        if CB is not None:
            data = CB  # bitsandbytes keeps data and CB as one tensor
        if data.dtype == torch.int8 and requires_grad:
            requires_grad = False  # integer tensors cannot require grad (bitsandbytes callers pass the default True)
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self.has_fp16_weights = bool(has_fp16_weights)
        self.SCB = SCB
        return self

    @property
    def CB(self) -> torch.Tensor | None:
        return self.data if self.data.dtype == torch.int8 else None

    @CB.setter
    def CB(self, value) -> None:
        # bitsandbytes' Linear8bitLt moves CB to its MatmulLtState and sets None here; data stays the codes.
        if value is not None:
            self.data = value

    @property
    def is_quantized(self) -> bool:
        return self.data.dtype == torch.int8

    def _quantize(self, device) -> Int8Params:
        if self.has_fp16_weights:
            self.data = self.data.to(device)
            return self
        if self.data.dim() != 2:
            raise ValueError(f"weight: expected a 2-D [out_features, in_features] tensor, got shape "
                             f"{tuple(self.data.shape)}")
        # (row scales: a slice of rows at a time, converted and moved as it goes, bounds the temporaries)
        CB, SCB, _ = by_rows(
            lambda rows: int8_vectorwise_quant(rows.to(device=device, dtype=torch.float16).contiguous()), self.data)
        self.requires_grad_(False)
        self.data = CB  # the full-precision tensor is released here unless someone else holds it
        self.SCB = SCB
        return self

    def to(self, *args, **kwargs) -> Int8Params:
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if not self.is_quantized and not self.has_fp16_weights and device is not None and device.type != "meta":
            if dtype is not None:
                self.data = self.data.to(dtype)
            return self._quantize(device)
        if self.is_quantized:
            dtype = None  # codes are not values to cast
            if device is not None and self.SCB is not None and self.SCB.device.type != "meta":
                self.SCB = self.SCB.to(device, non_blocking=non_blocking)
        data = super().to(device=device, dtype=dtype, non_blocking=non_blocking)
        return Int8Params(data.data if isinstance(data, Int8Params) else data, requires_grad=self.requires_grad,
                          has_fp16_weights=self.has_fp16_weights, SCB=self.SCB)

    def cpu(self) -> Int8Params:
        return self.to(device="cpu")

    def cuda(self, device=None, non_blocking: bool = False) -> Int8Params:
        return self.to(device="cuda" if device is None else device, non_blocking=non_blocking)

    def __deepcopy__(self, memo) -> Int8Params:
        if id(self) in memo:
            return memo[id(self)]
        new = Int8Params(self.data.clone(), requires_grad=self.requires_grad, has_fp16_weights=self.has_fp16_weights,
                         SCB=copy.deepcopy(self.SCB, memo))
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        return Int8Params, (self.data, self.requires_grad, self.has_fp16_weights, None, self.SCB)

    def __repr__(self) -> str:
        if not self.is_quantized:
            return (f"Int8Params(not quantized: {self.dtype} {tuple(self.shape)}, "
                    f"has_fp16_weights={self.has_fp16_weights})")
        return f"Int8Params(int8 {tuple(self.shape)} on {self.device}, SCB {tuple(self.SCB.shape)})"
