"""``Params4bit``: a weight that quantizes itself to NF4 / FP4 on its first move, as bitsandbytes' does.

Life of one (bitsandbytes' contract, which transformers, PEFT and accelerate rely on):

- Built from a full-precision tensor, it stays full precision (``bnb_quantized=False``) until the first
  ``.to(device)`` / ``.cuda()`` / ``.cpu()`` to a real device -- the CPU included, as bitsandbytes does
  (``Linear4bit(...).to("cpu")`` quantizes on the CPU).  A move to ``meta`` never quantizes.  The param
  then holds the packed codes (``quant_storage``, shape ``[(N*K + 1) // (2 * itemsize), 1]``) and
  ``quant_state`` the rest.  Quantizing replaces the data in place and returns the same object, so
  ``nn.Module.to`` keeps it.
- Moving a quantized param moves its QuantState too (in place: the state is shared with the module)
  and returns a new Params4bit with the same attributes.  A move to ``meta`` gives the new param a meta copy
  of the state instead, and leaves the shared one (the module's ``quant_state``) where it is; a move from meta
  back to a real device takes the module's state again.  That is accelerate's offload: its hooks move each
  weight to meta between calls and rebuild it from their own copy of the packed bytes -- of the parameter
  only -- as ``Params4bit(bytes, **meta_param.__dict__).to(device)``.  bitsandbytes moves the shared state to
  meta in place, which loses it: ``cpu_offload`` / ``dispatch_model`` with offloaded bitsandbytes 4-bit
  layers fail with "Cannot copy out of meta tensor".  A dtype given to the move is ignored once
  quantized: the packed bytes are a container whose dtype is ``quant_storage``, not a value to cast
  (``model.to(torch.bfloat16)`` would otherwise scramble a bf16 ``quant_storage``).
- ``Params4bit(data, requires_grad=False, **old.__dict__)`` rebuilds an equivalent param: ``__dict__``
  holds exactly the constructor's keyword arguments (PEFT merges adapters this way), and unknown
  keywords are ignored as bitsandbytes ignores them.
- ``from_prequantized(packed, stats)`` wraps a checkpoint's packed weight and its QuantState items.
- ``torch.chunk`` / ``torch.split`` (and the methods) return Params4bit pieces that keep the attributes
  (``quant_state``, ``module``, ``bnb_quantized``, ...), as bitsandbytes' do, for sharding code that splits a
  param and expects the pieces to be the param's kind; every other op gives plain tensors (``nn.Parameter``'s
  rule).
- ``module`` (the layer that owns the param, whose ``quant_state`` it keeps in step) is held weakly, so a dropped
  layer and its weight are freed at once, not at the next garbage collection (a layer and its param refer to
  each other; bitsandbytes' strong reference makes that a cycle, and GPU memory then stays allocated after
  ``del model`` until ``gc.collect()``).  ``__dict__["module"]`` holds the weak reference; the attribute and the
  constructor give and take the layer itself (or the weak reference, for ``Params4bit(data, **old.__dict__)``).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

from ..ops.quant_common import QUANT_STORAGES, QUANT_TYPES_4BIT, check_blocksize
from ..quant import QuantState, quantize_4bit

DEFAULT_BLOCKSIZE = 64
# The constructor's keyword arguments, which are also everything kept in __dict__ (see the module doc).
_ATTRIBUTES = ("blocksize", "compress_statistics", "quant_type", "quant_state", "quant_storage", "bnb_quantized",
               "module")


def check_4bit_options(quant_type, blocksize, quant_storage) -> None:
    if quant_type not in QUANT_TYPES_4BIT:
        raise ValueError(f"quant_type: expected 'nf4' or 'fp4', got {quant_type!r}")
    check_blocksize(blocksize)
    if quant_storage not in QUANT_STORAGES:
        raise ValueError(f"quant_storage: expected one of {', '.join(map(str, QUANT_STORAGES))}, "
                         f"got {quant_storage!r}")


class Params4bit(torch.nn.Parameter):
    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = False,
                quant_state: QuantState | None = None, blocksize: int | None = None, compress_statistics: bool = True,
                quant_type: str = "fp4", quant_storage: torch.dtype = torch.uint8, module=None,
                bnb_quantized: bool = False, **kwargs) -> Params4bit:
        blocksize = DEFAULT_BLOCKSIZE if blocksize is None else blocksize
        check_4bit_options(quant_type, blocksize, quant_storage)
        if data is None:
            data = torch.empty(0)
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"data: expected a tensor (or None), got {type(data).__name__}")
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self.blocksize = blocksize
        self.compress_statistics = compress_statistics
        self.quant_type = quant_type
        self.quant_state = quant_state
        self.quant_storage = quant_storage
        self.bnb_quantized = bnb_quantized
        self.module = module
        return self

    @property
    def module(self):
        ref = self.__dict__.get("module")
        return ref() if ref is not None else None

    @module.setter
    def module(self, module) -> None:
        if isinstance(module, weakref.ref):
            module = module()
        self.__dict__["module"] = weakref.ref(module) if module is not None else None

    @classmethod
    def from_prequantized(cls, data: torch.Tensor, quantized_stats: dict[str, Any], requires_grad: bool = False,
                          device="cuda", module=None, **kwargs) -> Params4bit:
        """A quantized param from a checkpoint: ``data`` the packed weight (its dtype is the quant_storage),
        ``quantized_stats`` the QuantState items (``absmax``, ``quant_map``, ..., ``quant_state.bitsandbytes__nf4``;
        prefixed keys are fine).  Both go to ``device``.  No pickle: the blob is JSON."""
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"data: expected the packed weight tensor, got {type(data).__name__}")
        state = QuantState.from_dict(quantized_stats, device=device)
        if data.dtype not in QUANT_STORAGES:
            raise ValueError(f"data: expected packed codes stored as one of "
                             f"{', '.join(map(str, QUANT_STORAGES))}, got {data.dtype}")
        self = cls(data.to(device), requires_grad=requires_grad, quant_state=state, blocksize=state.blocksize,
                   compress_statistics=state.nested, quant_type=state.quant_type, quant_storage=data.dtype,
                   module=module, bnb_quantized=True)
        if module is not None:
            module.quant_state = state
        return self

    # -- quantize on move -------------------------------------------------------------------------

    def _quantize(self, device) -> Params4bit:
        expected = _full_shape(self.module)
        if expected is not None and tuple(self.data.shape) != expected:
            # a packed checkpoint weight put in without its quant-state items (accelerate's load_checkpoint_in_model
            # sets only parameters, cast to the unquantized param's dtype): quantizing it would be silent garbage
            raise ValueError(f"weight: expected the full-precision {list(expected)} weight of this "
                             f"{type(self.module).__name__} to quantize, got shape {list(self.data.shape)} "
                             f"({self.data.dtype}); a packed 4-bit checkpoint loads with its quant-state items "
                             f"(weight.absmax, weight.quant_state.bitsandbytes__*) through load_state_dict")
        weight = self.data.contiguous().to(device)
        packed, state = quantize_4bit(weight, blocksize=self.blocksize, compress_statistics=self.compress_statistics,
                                      quant_type=self.quant_type, quant_storage=self.quant_storage)
        self.data = packed  # the full-precision tensor is released here unless someone else holds it
        self.quant_state = state
        self.bnb_quantized = True
        if self.module is not None:
            self.module.quant_state = state
        return self

    def to(self, *args, **kwargs) -> Params4bit:
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if not self.bnb_quantized:
            if device is not None and device.type != "meta":
                if dtype is not None:  # nn.Module.to(device, dtype): the weight is quantized from that dtype
                    self.data = self.data.to(dtype)
                return self._quantize(device)
            return self._rewrap(super().to(device=device, dtype=dtype, non_blocking=non_blocking))
        moved = self._rewrap(super().to(device=device, non_blocking=non_blocking))
        state = self.quant_state
        if device is None or state is None:
            return moved
        if device.type == "meta":  # see the module doc: the shared state stays where it is
            moved.quant_state = _meta_copy(state)
            return moved
        if state.absmax.is_meta:  # back from meta: the layer's own state (accelerate's offload, module doc)
            own = getattr(self.module, "quant_state", None)
            if own is None or own.absmax.is_meta:
                raise ValueError(f"quant_state: on the meta device, with no layer holding it elsewhere; it cannot "
                                 f"move to {device} (load a state_dict with the quant-state items instead)")
            moved.quant_state = state = own
        state.to(device)
        return moved

    def cpu(self) -> Params4bit:
        return self.to(device="cpu")

    def cuda(self, device=None, non_blocking: bool = False) -> Params4bit:
        return self.to(device="cuda" if device is None else device, non_blocking=non_blocking)

    def _keep_packed(self, cast: str) -> torch.Tensor:
        # ``model.half()`` and friends cast every floating tensor; a quantized weight's bytes are not values.
        return self if self.bnb_quantized else getattr(super(), cast)()

    def half(self):
        return self._keep_packed("half")

    def bfloat16(self):
        return self._keep_packed("bfloat16")

    def float(self):
        return self._keep_packed("float")

    def double(self):
        return self._keep_packed("double")

    _SPLITS = (torch.chunk, torch.split, torch.Tensor.chunk, torch.Tensor.split)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func not in cls._SPLITS or not isinstance(args[0], Params4bit):
            return result
        return tuple(args[0]._rewrap(piece) for piece in result)

    def _rewrap(self, data: torch.Tensor) -> Params4bit:
        attrs = {name: self.__dict__.get(name) for name in _ATTRIBUTES}
        return Params4bit(data, requires_grad=self.requires_grad, **attrs)

    # -- copy / deepcopy / pickle -----------------------------------------------------------------

    def __getstate__(self) -> dict:
        return {name: getattr(self, name) if name == "module" else self.__dict__.get(name) for name in _ATTRIBUTES}

    def __setstate__(self, state: dict) -> None:
        for name in _ATTRIBUTES:
            setattr(self, name, state.get(name))

    def __copy__(self) -> Params4bit:
        """Shallow: a new param over the same storage and the same QuantState object."""
        return self._rewrap(self.data)

    def __deepcopy__(self, memo) -> Params4bit:
        if id(self) in memo:
            return memo[id(self)]
        attrs = self.__getstate__()
        # The module back-reference follows the copy when the copy started from the module (it is then in
        # memo); a param copied alone keeps pointing at its original module, as bitsandbytes' does.
        module = attrs.pop("module")
        attrs["module"] = memo.get(id(module), module) if module is not None else None
        attrs["quant_state"] = copy.deepcopy(attrs["quant_state"], memo)
        new = Params4bit(self.data.clone(), requires_grad=self.requires_grad, **attrs)
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        return _rebuild_params4bit, (self.data, self.requires_grad, self.__getstate__())

    # -- QuantState items as attributes (FSDP resolves state-dict keys like "weight.absmax" with getattr) --

    def _state_item(self, name: str, get, nested: bool = False):
        state = self.__dict__.get("quant_state")
        if state is None or (nested and state.state2 is None):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return get(state)

    absmax = property(lambda self: self._state_item("absmax", lambda s: s.absmax))
    code = property(lambda self: self._state_item("code", lambda s: s.code))
    quant_map = property(lambda self: self._state_item("quant_map", lambda s: s.code))
    offset = property(lambda self: self._state_item("offset", lambda s: s.offset))
    state2 = property(lambda self: self._state_item("state2", lambda s: s.state2))
    nested_absmax = property(lambda self: self._state_item("nested_absmax", lambda s: s.state2.absmax, True))
    nested_blocksize = property(lambda self: self._state_item("nested_blocksize", lambda s: s.state2.blocksize, True))
    nested_quant_map = property(lambda self: self._state_item("nested_quant_map", lambda s: s.state2.code, True))
    nested_dtype = property(lambda self: self._state_item("nested_dtype", lambda s: s.state2.dtype, True))
    nested_offset = property(lambda self: self._state_item("nested_offset", lambda s: s.offset))

    def __repr__(self) -> str:
        if not self.bnb_quantized:
            return f"Params4bit({self.quant_type}, not quantized yet: {self.dtype} {tuple(self.shape)})"
        return f"Params4bit({self.quant_state!r}, storage {self.dtype} {tuple(self.shape)} on {self.device})"


def _meta_copy(state: QuantState) -> QuantState:
    """A QuantState with the same settings and its tensors on meta; ``state`` itself is not touched.  The nested
    offset (one scalar) stays a real number: the state_dict's JSON blob records it as one, and accelerate takes
    ``state_dict()`` of modules whose weights it has moved to meta."""
    meta = copy.copy(state)
    if state.state2 is not None:
        meta.state2 = copy.copy(state.state2)
    meta.to("meta")
    meta.offset = state.offset
    return meta


def _full_shape(module) -> tuple[int, int] | None:
    """The full-precision weight shape of the 4-bit layer a param belongs to (Linear4bit, Embedding4bit)."""
    if module is None:
        return None
    if hasattr(module, "out_features") and hasattr(module, "in_features"):
        return int(module.out_features), int(module.in_features)
    if hasattr(module, "num_embeddings") and hasattr(module, "embedding_dim"):
        return int(module.num_embeddings), int(module.embedding_dim)
    return None


def _rebuild_params4bit(data: torch.Tensor, requires_grad: bool, state: dict) -> Params4bit:
    return Params4bit(data, requires_grad=requires_grad, **state)
