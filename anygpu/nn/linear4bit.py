"""``Linear4bit`` (and ``LinearNF4`` / ``LinearFP4``): bitsandbytes' 4-bit linear layer, same constructor,
same state_dict, computing with ``anygpu.quant.matmul.matmul_4bit`` (Triton on GPUs, PyTorch on the CPU).

- The weight is a ``Params4bit``: full precision until the module's first move to a device (the CPU
  included), or at the latest its first forward, which quantizes it where it is.
- forward (bitsandbytes' compute-dtype rules): with ``compute_dtype`` unset, the first input decides --
  fp32 and bf16 inputs are computed in their own dtype from then on; an fp16 input is computed in fp16
  and warned about, as bitsandbytes warns (its configs default the compute dtype to fp32).  x and bias
  are cast to the compute dtype and the output back to the input's dtype.  An fp16 input with
  ``compute_dtype=torch.float32`` is also warned about (upcast: slow).  The bias is cast per call, never
  in place, so its gradient (if it trains) stays in its own dtype.
- Gradients flow to x and bias through the frozen weight (QLoRA); the weight never gets one.
- On the CPU the layer keeps its dequantized weight (in the compute dtype) and calls ``F.linear`` -- the op's
  reference, bit for bit -- instead of dequantizing on every call, while a process-wide budget allows
  (``anygpu/nn/_cpu_weight_cache.py``: ``ANYGPU_CPU_WEIGHT_CACHE_MB``, default a quarter of the RAM); past it,
  layers dequantize per call.  The cache is not in the state_dict, and is rebuilt when the weight changes.
- state_dict: bitsandbytes' keys -- ``weight`` (packed), ``weight.absmax``, ``weight.quant_map``,
  ``weight.nested_absmax``, ``weight.nested_quant_map``, ``weight.quant_state.bitsandbytes__nf4|__fp4``
  (JSON in a uint8 tensor), ``bias``.  Loading reads the same keys (from bitsandbytes, transformers or
  anygpu checkpoints) without pickle; a full-precision ``weight`` of shape [out, in] is loaded as
  bitsandbytes does (to be quantized on the next move) or, into an already quantized layer, quantized
  at once with the layer's settings.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.matmul_4bit import dequantize_weight
from ..quant.functional import _plain_absmax
from ..quant.matmul import matmul_4bit
from . import _cpu_weight_cache as cpu_cache
from ._source_linear import source_weight
from .params4bit import Params4bit, check_4bit_options

COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# QuantState items saved next to the packed weight, as "weight.<item>" (the blob's key ends in bitsandbytes__*).
QUANT_STATE_ITEMS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def check_compute_dtype(compute_dtype) -> None:
    if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype: expected None, torch.float16, torch.bfloat16 or torch.float32, "
                         f"got {compute_dtype!r}")


def _is_quant_state_key(suffix: str) -> bool:
    return suffix in QUANT_STATE_ITEMS or suffix.startswith("quant_state.")


class Linear4bit(cpu_cache.CachesCPUWeight, nn.Linear):
    def __init__(self, input_features: int, output_features: int, bias: bool = True, compute_dtype=None,
                 compress_statistics: bool = True, quant_type: str = "fp4", quant_storage: torch.dtype = torch.uint8,
                 device=None, blocksize: int | None = None):
        check_compute_dtype(compute_dtype)
        check_4bit_options(quant_type, 64 if blocksize is None else blocksize, quant_storage)
        super().__init__(input_features, output_features, bias, device)
        self.weight = Params4bit(self.weight.data, requires_grad=False, blocksize=blocksize,
                                 compress_statistics=compress_statistics, quant_type=quant_type,
                                 quant_storage=quant_storage, module=self)
        self.compute_dtype = compute_dtype
        self.compute_type_is_set = compute_dtype is not None
        self.quant_state = None  # mirrors weight.quant_state (bitsandbytes keeps it here for FSDP's sake)
        self.quant_storage = quant_storage
        self._cpu_weight = None  # a _cpu_weight_cache.Entry: the dequantized weight for CPU calls

    @staticmethod
    def from_linear(linear: nn.Linear, quant_type: str = "nf4", *, compute_dtype=None,
                    compress_statistics: bool = True, quant_storage: torch.dtype = torch.uint8,
                    blocksize: int | None = None, device=None) -> Linear4bit:
        """A ``Linear4bit`` quantizing ``linear`` on ``device`` (default: where its weight is).  The bias Parameter
        is reused (moved if needed); the full-precision weight is not kept."""
        weight, device = source_weight(linear, device)
        # Built on meta: nothing allocated or initialised for a weight about to be replaced.
        layer = Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=compute_dtype,
                           compress_statistics=compress_statistics, quant_type=quant_type,
                           quant_storage=quant_storage, device="meta", blocksize=blocksize)
        layer.weight = Params4bit(weight, requires_grad=False, blocksize=blocksize,
                                  compress_statistics=compress_statistics, quant_type=quant_type,
                                  quant_storage=quant_storage, module=layer)
        layer.weight._quantize(device)
        if linear.bias is not None:
            bias = linear.bias
            layer.bias = bias if bias.device == device else nn.Parameter(bias.detach().to(device), bias.requires_grad)
        layer.train(linear.training)
        return layer

    # -- forward --------------------------------------------------------------------------------

    def _current_quant_state(self):
        weight = self.weight
        state = getattr(weight, "quant_state", None)
        if state is not None:
            return state
        if getattr(weight, "bnb_quantized", True) is False:  # never moved: quantize where it is
            if weight.device.type == "meta":
                raise ValueError("weight: on the meta device; load a state_dict or move the layer to a device first")
            return weight._quantize(weight.device).quant_state
        if self.quant_state is None:
            raise ValueError("weight: expected a quantized Params4bit (move the layer to a device first), got "
                             f"{type(weight).__name__} without a quant_state")
        # Something (FSDP) replaced the param by a plain one over the same packed bytes: re-attach the state.
        self.weight = Params4bit(weight.data, requires_grad=False, quant_state=self.quant_state,
                                 blocksize=self.quant_state.blocksize, compress_statistics=self.quant_state.nested,
                                 quant_type=self.quant_state.quant_type, quant_storage=weight.dtype, module=self,
                                 bnb_quantized=True)
        return self.quant_state

    def set_compute_type(self, x: torch.Tensor) -> None:
        if x.dtype in (torch.float32, torch.bfloat16):
            self.compute_dtype = x.dtype  # safe to compute in: adopt it
        elif x.dtype == torch.float16:
            warnings.warn("Linear4bit: the input is torch.float16 and compute_dtype is unset (bitsandbytes' configs "
                          "default it to float32, which is slow for fp16 inputs); computing in the input's dtype. "
                          "Pass compute_dtype=torch.float16 to say so.", UserWarning, stacklevel=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quant_state = self._current_quant_state()
        if not self.compute_type_is_set:
            self.set_compute_type(x)
            self.compute_type_is_set = True
        elif x.dtype == torch.float16 and self.compute_dtype == torch.float32 and not getattr(self, "_warned", False):
            self._warned = True
            warnings.warn("Linear4bit: float16 input with compute_dtype=torch.float32 is upcast on every call "
                          "(slow); pass compute_dtype=torch.float16 for fp16 inputs", UserWarning, stacklevel=2)
        input_dtype = x.dtype
        if self.compute_dtype is not None and input_dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if x.device.type == "cpu" and x.shape[-1] == self.in_features and not torch.compiler.is_compiling():
            weight = self._cached_cpu_weight(quant_state, x.dtype)
            if weight is not None:  # the reference's own arithmetic on the same bits: F.linear(x, dequant(W), bias)
                y = F.linear(x, weight, bias)
                return y if y.dtype == input_dtype else y.to(input_dtype)
        weight = self.weight.data  # the packed bytes as a plain tensor: no subclass dispatch per call
        return matmul_4bit(x, weight, quant_state, bias=bias).to(input_dtype)

    def _cached_cpu_weight(self, quant_state, dtype: torch.dtype) -> torch.Tensor | None:
        """The dequantized weight in ``dtype`` from the layer's CPU cache (see ``_cpu_weight_cache``), built on a
        miss if the budget allows; None when it does not or the weight is not a CPU 4-bit weight."""
        param, absmax = self.weight, quant_state.absmax
        if param.device.type != "cpu" or dtype not in COMPUTE_DTYPES or absmax.device.type != "cpu":
            return None
        n, k = (int(d) for d in quant_state.shape)
        return cpu_cache.lookup(self, (param, absmax), dtype, n * k, lambda: self._dequantize(quant_state, n, k, dtype))

    def _dequantize(self, quant_state, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        # The arguments anygpu.quant.matmul.matmul_4bit gives the op, so the weight is the reference's, bit for bit.
        # Built as a normal tensor even in inference mode: a later training step may save it for backward.
        with torch.inference_mode(False), torch.no_grad():
            return self._dequantize_now(quant_state, n, k, dtype)

    def _dequantize_now(self, quant_state, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        packed, state = self.weight.data, quant_state
        if state.nested and state.state2.blocksize == 256:
            nest = (state.state2.absmax, state.state2.code, state.offset.reshape(1))
            return dequantize_weight(packed, state.absmax, state.code, state.blocksize, n, k, dtype, *nest)
        return dequantize_weight(packed, _plain_absmax(state), state.code, state.blocksize, n, k, dtype)

    # -- full-precision view, for adapters that merge into the weight (PEFT's merge_and_unload) -----

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as a new full-precision [out_features, in_features] tensor (default: the dtype it was
        quantized from), with the bits ``forward`` computes with."""
        quant_state = self._current_quant_state()
        n, k = (int(d) for d in quant_state.shape)
        return self._dequantize(quant_state, n, k, quant_state.dtype if dtype is None else dtype)

    def requantize_(self, weight: torch.Tensor) -> None:
        """Replace the weight by ``weight`` ([out_features, in_features], full precision), quantized now where the
        layer is with its settings (type, blocksize, nesting, storage); the CPU cache is rebuilt on the next call."""
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError(f"weight: expected a floating-point tensor, got {getattr(weight, 'dtype', type(weight))}")
        self._current_quant_state()  # a layer never moved is quantized first, so the new weight is too
        errors: list = []
        self._cpu_weight = None
        self._load_full_precision(weight, True, "weight", errors)
        if errors:
            raise ValueError(errors[0])

    # -- state_dict in bitsandbytes' format -------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)  # weight (packed) and bias
        state = getattr(self.weight, "quant_state", None)
        if state is not None:
            for key, value in state.as_dict(packed=True).items():
                destination[f"{prefix}weight.{key}"] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        weight_key = prefix + "weight"
        stats, rest = {}, {}
        for key, value in state_dict.items():
            suffix = key[len(weight_key) + 1:] if key.startswith(weight_key + ".") else None
            if suffix is not None and _is_quant_state_key(suffix):
                stats[suffix] = value
            else:
                rest[key] = value
        # copy, as load_state_dict does, unless told to assign: a layer must not alias another module's tensors
        copy = not (local_metadata or {}).get("assign_to_params_buffers", False)
        weight = rest.pop(weight_key, None)
        if weight is not None and stats:
            self._load_prequantized(weight, stats, copy)
        elif weight is not None:
            self._load_full_precision(weight, copy, weight_key, error_msgs)
        elif stats:
            error_msgs.append(f"{weight_key}: the checkpoint has the quant state items {sorted(stats)} but not the "
                              f"packed weight itself")
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if weight is not None and weight_key in missing_keys:
            missing_keys.remove(weight_key)  # handled above, out of the base class's sight

    def _load_prequantized(self, packed: torch.Tensor, stats: dict, copy: bool) -> None:
        device = self.weight.device if self.weight.device.type != "meta" else packed.device
        if copy:
            packed = packed.detach().clone()
            stats = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in stats.items()}
        weight = Params4bit.from_prequantized(packed, stats, requires_grad=False, device=device, module=self)
        shape = tuple(weight.quant_state.shape)
        if shape != (self.out_features, self.in_features):
            raise ValueError(f"state_dict: expected a quant state of shape ({self.out_features}, {self.in_features}) "
                             f"for this layer's weight, got {shape}")
        self.weight = weight

    def _load_full_precision(self, tensor: torch.Tensor, copy: bool, key: str, error_msgs: list) -> None:
        """bitsandbytes' path for nn.Linear checkpoints: into a layer not quantized yet (to be quantized on the
        next move, in the layer's dtype); into a quantized one, quantized now where the layer is."""
        if tuple(tensor.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"{key}: expected a full-precision [{self.out_features}, {self.in_features}] weight, "
                              f"or a packed one with its quant state items, got shape {tuple(tensor.shape)}")
            return
        old = self.weight
        state = getattr(old, "quant_state", None)
        dtype = state.dtype if state is not None else old.dtype
        device = old.device if old.device.type != "meta" else tensor.device
        tensor = tensor.detach().to(device=device, dtype=dtype, copy=copy)
        self.weight = Params4bit(tensor, requires_grad=False, blocksize=old.blocksize,
                                 compress_statistics=old.compress_statistics, quant_type=old.quant_type,
                                 quant_storage=old.quant_storage, module=self)
        if getattr(old, "bnb_quantized", False):
            self.weight._quantize(device)

    def extra_repr(self) -> str:
        state = getattr(self.weight, "quant_state", None)
        quant = f"{state.quant_type}, blocksize={state.blocksize}, nested={state.nested}" if state is not None \
            else f"{self.weight.quant_type}, not quantized yet"
        return f"{super().extra_repr()}, {quant}, compute_dtype={self.compute_dtype}"


class LinearNF4(Linear4bit):
    def __init__(self, input_features: int, output_features: int, bias: bool = True, compute_dtype=None,
                 compress_statistics: bool = True, quant_storage: torch.dtype = torch.uint8, device=None):
        super().__init__(input_features, output_features, bias, compute_dtype, compress_statistics, "nf4",
                         quant_storage, device)


class LinearFP4(Linear4bit):
    def __init__(self, input_features: int, output_features: int, bias: bool = True, compute_dtype=None,
                 compress_statistics: bool = True, quant_storage: torch.dtype = torch.uint8, device=None):
        super().__init__(input_features, output_features, bias, compute_dtype, compress_statistics, "fp4",
                         quant_storage, device)
