"""``Linear8bitLt``: bitsandbytes' LLM.int8() linear layer, same constructor, same state_dict, computing with
``anygpu.quant.int8.matmul_8bit``.

- The weight is an ``Int8Params``.  With ``has_fp16_weights=False`` (what inference and ``quantize_model``
  use) it is quantized to row-wise int8 (``CB`` [N, K], ``SCB`` [N]) on the layer's first move to a device,
  the CPU included, or at the latest on its first forward, where it is.  With ``has_fp16_weights=True``
  (bitsandbytes' default) the weight stays full precision and trainable: each forward quantizes it on the
  fly and its gradient is computed in full precision.
- forward: bitsandbytes' MatMul8bitLt on every device, training or not (bitsandbytes switches to a
  dequantize + F.linear path when training on the CPU; we do not: one semantics everywhere).  Inputs are
  quantized from fp16, the output has the input's dtype, the bias is cast per call (never in place).
  ``threshold`` > 0 keeps the input columns holding a value >= threshold in magnitude out of int8.
  On CUDA / ROCm tensors it runs the Triton kernels of ``anygpu.ops.int8_matmul`` (no host sync: a decode
  step captures in a CUDA / HIP graph), on the CPU the PyTorch reference: the same bits without outlier
  columns, within one unit in the last place with them.
- state_dict: ``weight`` (int8), ``bias``, ``SCB`` (fp32) and ``weight_format`` (uint8 0 = "row") once
  quantized; before that, ``weight`` and ``bias`` as nn.Linear.  Loading accepts bitsandbytes' and our
  checkpoints into a quantized layer and, unlike bitsandbytes, into one not quantized yet (the int8
  weight and SCB are taken as they are); legacy ``weight_format`` 1 / 2 / 3 (col32, col_turing,
  col_ampere) is a ValueError.  A full-precision ``weight`` (an nn.Linear checkpoint) is kept to be
  quantized on the next move or, into a quantized layer, quantized at once.
- ``state``: a view standing in for bitsandbytes' ``MatmulLtState`` (what PEFT and TGI read):
  ``threshold``, ``has_fp16_weights``, ``is_training``, and ``CB`` / ``SCB``, which are the weight's --
  the codes and scales live in ``weight`` only, so a move or a deepcopy never leaves a stale copy.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quant.int8 import int8_vectorwise_quant, matmul_8bit
from ._source_linear import source_weight
from .int8params import Int8Params

# bitsandbytes' LINEAR_8BIT_WEIGHTS_FORMAT_MAPPING: only "row" (0) is still readable.
WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}


class Int8State:
    """bitsandbytes' ``MatmulLtState`` fields, read from and written to the layer (a view, not a copy)."""

    __slots__ = ("_layer",)

    def __init__(self, layer: Linear8bitLt):
        self._layer = layer

    @property
    def threshold(self) -> float:
        return self._layer._threshold

    @threshold.setter
    def threshold(self, value) -> None:
        self._layer._threshold = check_threshold(value)

    @property
    def has_fp16_weights(self) -> bool:
        return self._layer._has_fp16_weights

    @has_fp16_weights.setter
    def has_fp16_weights(self, value) -> None:
        self._layer._has_fp16_weights = bool(value)

    @property
    def is_training(self) -> bool:
        return self._layer.training

    @property
    def CB(self) -> torch.Tensor | None:
        weight = self._layer.weight
        return weight.data if weight.dtype == torch.int8 else None

    @property
    def SCB(self) -> torch.Tensor | None:
        weight = self._layer.weight
        return getattr(weight, "SCB", None) if weight.dtype == torch.int8 else None

    @SCB.setter
    def SCB(self, value) -> None:  # PEFT writes ``state.SCB = weight.SCB``
        if value is not None:
            self._layer.weight.SCB = value


def check_threshold(threshold) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"threshold: expected a number >= 0 (0 = pure int8), got {threshold!r}")
    return float(threshold)


def _weight_format_name(value) -> str:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, int) and value in WEIGHT_FORMATS:
        value = WEIGHT_FORMATS[value]
    if value != "row":
        raise ValueError(f"weight_format: only the row-major int8 format (0, 'row') is supported, got {value!r} "
                         f"(col32 / col_turing / col_ampere checkpoints come from bitsandbytes < 0.45: re-save them "
                         f"with a recent bitsandbytes)")
    return value


class Linear8bitLt(nn.Linear):
    def __init__(self, input_features: int, output_features: int, bias: bool = True, has_fp16_weights: bool = True,
                 threshold: float = 0.0, index=None, device=None):
        threshold = check_threshold(threshold)
        super().__init__(input_features, output_features, bias, device)
        self._threshold, self._has_fp16_weights = threshold, bool(has_fp16_weights)
        self.index = index
        self.weight = Int8Params(self.weight.data, requires_grad=has_fp16_weights, has_fp16_weights=has_fp16_weights)

    @staticmethod
    def from_linear(linear: nn.Linear, threshold: float = 0.0, *, device=None) -> Linear8bitLt:
        """An int8 (``has_fp16_weights=False``) layer quantizing ``linear`` on ``device`` (default: where its weight
        is).  The bias Parameter is reused (moved if needed); the full-precision weight is not kept."""
        weight, device = source_weight(linear, device)
        layer = Linear8bitLt(linear.in_features, linear.out_features, bias=False, has_fp16_weights=False,
                             threshold=threshold, device="meta")
        layer.weight = Int8Params(weight, requires_grad=False, has_fp16_weights=False)._quantize(device)
        if linear.bias is not None:
            bias = linear.bias
            layer.bias = bias if bias.device == device else nn.Parameter(bias.detach().to(device), bias.requires_grad)
        layer.train(linear.training)
        return layer

    @property
    def state(self) -> Int8State:
        return Int8State(self)

    @property
    def threshold(self) -> float:
        return self._threshold

    # -- forward ------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if weight.dtype != torch.int8 and not getattr(weight, "has_fp16_weights", False):
            if weight.device.type == "meta":
                raise ValueError("weight: on the meta device; load a state_dict or move the layer to a device first")
            weight._quantize(weight.device)  # never moved: quantize where it is
        if weight.dtype == torch.int8:
            if getattr(weight, "SCB", None) is None:
                raise ValueError("weight: int8 codes without their SCB row scales (load the SCB from the checkpoint)")
            return matmul_8bit(x, weight.data, weight.SCB, self._threshold, bias)
        CB, SCB, _ = int8_vectorwise_quant(weight.detach().to(torch.float16))  # has_fp16_weights: per call
        return matmul_8bit(x, CB, SCB, self._threshold, bias, B=weight)

    # -- full-precision view, for adapters that merge into the weight (PEFT's merge_and_unload) ------

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as a new full-precision [out_features, in_features] tensor: ``CB * SCB / 127`` once int8
        (default dtype fp16, what it was quantized from), else a copy of the full-precision weight."""
        weight = self.weight
        if weight.dtype != torch.int8:
            return weight.detach().to(dtype or weight.dtype, copy=True)
        if getattr(weight, "SCB", None) is None:
            raise ValueError("weight: int8 codes without their SCB row scales (load the SCB from the checkpoint)")
        full = weight.data.float() * (weight.SCB.float().unsqueeze(1) / 127.0)
        return full.to(dtype or torch.float16)

    def requantize_(self, weight: torch.Tensor) -> None:
        """Replace the weight by ``weight`` ([out_features, in_features], full precision): quantized to int8 now
        if the layer's weight is int8, kept full precision otherwise (``has_fp16_weights``)."""
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError(f"weight: expected a floating-point tensor, got {getattr(weight, 'dtype', type(weight))}")
        errors: list = []
        self._load_full_precision(weight, True, "weight", errors)
        if errors:
            raise ValueError(errors[0])

    # -- state_dict in bitsandbytes' format -----------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        scb = getattr(self.weight, "SCB", None)
        if self.weight.dtype == torch.int8 and scb is not None:
            destination[prefix + "SCB"] = scb if keep_vars else scb.detach()
            destination[prefix + "weight_format"] = torch.tensor(0, dtype=torch.uint8)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        weight_key, scb_key, format_key = prefix + "weight", prefix + "SCB", prefix + "weight_format"
        rest = {k: v for k, v in state_dict.items() if k not in (weight_key, scb_key, format_key)}
        weight, scb = state_dict.get(weight_key), state_dict.get(scb_key)
        if format_key in state_dict:
            _weight_format_name(state_dict[format_key])
        copy = not (local_metadata or {}).get("assign_to_params_buffers", False)
        if weight is not None and weight.dtype == torch.int8:
            if scb is None:
                error_msgs.append(f"{scb_key}: the checkpoint has an int8 {weight_key} but not its SCB row scales")
            else:
                self._load_int8(weight, scb, copy)
        elif weight is not None:
            if scb is not None:
                error_msgs.append(f"{weight_key}: expected int8 codes next to {scb_key}, got {weight.dtype}")
            else:
                self._load_full_precision(weight, copy, weight_key, error_msgs)
        elif scb is not None:
            error_msgs.append(f"{scb_key}: the checkpoint has the SCB row scales but not the int8 {weight_key}")
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if weight is not None and weight_key in missing_keys:
            missing_keys.remove(weight_key)  # handled above, out of the base class's sight

    def _target_device(self, tensor: torch.Tensor) -> torch.device:
        return self.weight.device if self.weight.device.type != "meta" else tensor.device

    def _load_int8(self, weight: torch.Tensor, scb: torch.Tensor, copy: bool) -> None:
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"state_dict: expected an int8 weight of shape {expected}, got {tuple(weight.shape)}")
        if scb.numel() != self.out_features or not scb.dtype.is_floating_point:
            raise ValueError(f"state_dict: expected SCB to hold {self.out_features} floating row scales, got "
                             f"{scb.dtype} {tuple(scb.shape)}")
        device = self._target_device(weight)
        weight = weight.detach().to(device, copy=copy)
        scb = scb.detach().to(device=device, dtype=torch.float32, copy=copy).reshape(self.out_features)
        self.weight = Int8Params(weight, requires_grad=False, has_fp16_weights=False, SCB=scb)
        self._has_fp16_weights = False

    def _load_full_precision(self, tensor: torch.Tensor, copy: bool, key: str, error_msgs: list) -> None:
        if tuple(tensor.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"{key}: expected a [{self.out_features}, {self.in_features}] weight, got shape "
                              f"{tuple(tensor.shape)}")
            return
        old = self.weight
        was_quantized = old.dtype == torch.int8
        dtype = torch.float16 if was_quantized else old.dtype
        tensor = tensor.detach().to(device=self._target_device(tensor), dtype=dtype, copy=copy)
        has_fp16 = getattr(old, "has_fp16_weights", self._has_fp16_weights)
        self.weight = Int8Params(tensor, requires_grad=has_fp16, has_fp16_weights=has_fp16)
        if was_quantized:
            self.weight._quantize(tensor.device)

    def extra_repr(self) -> str:
        kind = "int8" if self.weight.dtype == torch.int8 else f"{self.weight.dtype}, not quantized"
        return f"{super().extra_repr()}, {kind}, threshold={self._threshold}"
