"""One way to define an op: a torch.library custom op with a reference, a fake and a Triton kernel.

    silu_and_mul = define_op(
        "silu_and_mul(Tensor x) -> Tensor",
        check=...,        # validates arguments, raises ValueError naming the bad one (runs on every path)
        reference=...,    # pure PyTorch: the CPU backend, and the oracle every test compares against
        fake=...,         # shapes and dtypes only, so torch.compile and meta tensors work
        gpu=...,          # Triton launcher for CUDA and ROCm tensors (imported lazily: Triton is optional)
        cpu=...,          # optional: a faster CPU implementation (default: the reference)
        backward=..., setup_context=...,   # optional autograd formula
    )

A ``cpu`` implementation exists where the reference, written to be an oracle and to run on any device without a
host read (so a GPU that runs the references can still capture a graph), is slow on the CPU: there a host read
is free, and a decode step is bound by the count of small ops.  It keeps the reference's contract; its tests hold
it to the reference bit for bit, or to the accuracy rule where it sums in another order.

torch's dispatcher cannot tell ROCm from CUDA (both are the CUDA key), so the GPU implementation is one
function; the per-arch differences are in the kernel's config table (``kernels/launch.py``).
``ANYGPU_KERNELS=reference`` runs the reference on GPUs too, to tell a kernel bug from a model bug.  On a GPU
the installed Triton cannot compile for (gfx1030 with triton 3.9) every op runs its reference there too, found
once per device (``reference_only``).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

NAMESPACE = "anygpu"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # noqa: TOR901 - the namespace's owner for all defs


# nn.Parameter disables torch-function dispatch for itself: to the dispatcher it is a plain tensor (a model's
# norm weights are Parameters, and would otherwise send every norm through the slow path).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain_eager_device(tensors) -> str | None:
    """"cuda" or "cpu" when going through torch's dispatcher would change nothing but cost time: eager mode, not
    tracing, no autograd, no functorch transform (vmap, grad), no tensor subclass (FakeTensor), no
    torch-function or dispatch mode active, and every tensor (``tensors``: the op's tensor arguments, None
    for an absent optional one) on one kind of device.  None otherwise."""
    if torch.jit.is_tracing() or torch._C._is_torch_function_mode_enabled():
        return None
    if torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active():
        return None
    grad = torch.is_grad_enabled()
    kind = None
    for a in tensors:
        if a is None:
            continue
        if type(a) not in _PLAIN_TENSORS or (grad and a.requires_grad):
            return None
        # is_cuda / is_cpu: a flag read each, where device.type builds a device object (a decode step on the
        # CPU makes about 200 op calls, each with up to 8 tensors)
        here = "cuda" if a.is_cuda else "cpu" if a.is_cpu else None
        if here is None or (kind is not None and here != kind):
            return None
        kind = here
    return kind


@dataclass(frozen=True)
class Op:
    name: str
    schema: str
    reference: Callable
    check: Callable
    gpu_kernel: str | None  # "module:function" in anygpu.kernels
    gpu_impl: Callable  # what torch.ops.anygpu.<name> runs for CUDA / ROCm tensors
    cpu_impl: Callable  # what it runs for CPU tensors: check, then the cpu implementation (or the reference)

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def overload(self):
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    def __call__(self, *args, **kwargs):
        # Decode-sized calls are bound by host time, and a Python custom op's trip through torch's dispatcher
        # costs more than the launch itself.  When the dispatcher would only forward to gpu_impl or to the
        # checked CPU implementation, call it directly; autograd, torch.compile and meta/fake tensors still go
        # through torch.ops.
        if torch.compiler.is_compiling():  # dynamo binds arguments itself
            return self.overload(*args, **kwargs)
        if kwargs or len(args) < self._num_arguments:  # the schema's names and defaults, as torch.ops applies them
            args = self._bind(args, kwargs)
        tensors = []
        for i, name, optional in self._tensor_arguments:
            a = args[i] if i < len(args) else None
            if not isinstance(a, torch.Tensor) and not (optional and a is None):
                # Caught here, naming the argument: the checks and the kernels would fail on it with an
                # AttributeError ('list' object has no attribute 'dim'), or worse, read it as something else.
                raise TypeError(f"{self.name}: {name}: expected a torch.Tensor{' or None' if optional else ''}, "
                                f"got {type(a).__name__}")
            tensors.append(a)
        kind = _plain_eager_device(tensors)
        if kind == "cuda":
            return self.gpu_impl(*args)
        if kind == "cpu":
            return self.cpu_impl(*args)
        return self.overload(*args)

    def runs_kernel(self, device: torch.device) -> bool:
        """Whether a call on ``device`` runs the Triton kernel (not the CPU implementation or the reference)."""
        if device.type != "cuda" or self.gpu_kernel is None:
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return not _references_on(index) and _resolve(self.gpu_kernel) is not None

    @functools.cached_property
    def _num_arguments(self) -> int:
        return len(self.overload._schema.arguments)

    @functools.cached_property
    def _tensor_arguments(self) -> tuple[tuple[int, str, bool], ...]:
        """(position, name, None allowed) of each argument the schema types Tensor or Tensor?."""
        out = []
        for i, arg in enumerate(self.overload._schema.arguments):
            t = arg.type
            optional = t.kind() == "OptionalType"
            if (t.getElementType() if optional else t).kind() == "TensorType":
                out.append((i, arg.name, optional))
        return tuple(out)

    def _bind(self, args: tuple, kwargs: dict) -> tuple:
        schema = self.overload._schema
        names = [a.name for a in schema.arguments]
        unknown = set(kwargs) - set(names)
        if unknown:
            raise TypeError(f"{self.name}() got unexpected keyword arguments {sorted(unknown)}")
        twice = set(kwargs) & set(names[:len(args)])
        if twice:
            raise TypeError(f"{self.name}() got multiple values for arguments {sorted(twice)}")
        bound = list(args)
        for arg in schema.arguments[len(args):]:
            if arg.name in kwargs:
                bound.append(kwargs[arg.name])
            elif arg.has_default_value():
                bound.append(arg.default_value)
            else:
                raise TypeError(f"{self.name}() missing required argument {arg.name!r}")
        return tuple(bound)


def _kernels_choice() -> str:
    value = os.environ.get("ANYGPU_KERNELS", "triton").strip().lower() or "triton"
    if value not in ("triton", "reference"):
        raise ValueError(f"ANYGPU_KERNELS={value!r}: expected 'triton' (the default) or 'reference'")
    return value


_REFERENCE_ONLY: dict[int, str | None] = {}


def reference_only(index: int) -> str | None:
    """Why GPU ``index`` runs the references (Triton cannot target its arch), or None.  Decided once per device
    per process: the first op on the device compiles a trivial kernel for its arch (``aot.triton_cannot_target``)."""
    if index not in _REFERENCE_ONLY:
        from ..kernels import HAS_TRITON

        reason = None
        if HAS_TRITON:
            from ..backend import describe_gpu
            from ..kernels.aot import triton_cannot_target

            target = describe_gpu(index).target
            error = triton_cannot_target(target)
            if error:
                reason = f"{target.arch}: Triton cannot target this GPU; ops run their PyTorch reference on it ({error})"
                warnings.warn(f"anygpu: {reason}", stacklevel=4)
        _REFERENCE_ONLY[index] = reason
    return _REFERENCE_ONLY[index]


def _references_on(index: int | None) -> bool:
    """The one decision behind every op's GPU dispatch (``index``: None, no GPU tensor)."""
    return _kernels_choice() == "reference" or (index is not None and reference_only(index) is not None)


def _gpu_index(args) -> int | None:
    """The device index of the first GPU tensor among an op's arguments."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "cuda":
            return a.device.index if a.device.index is not None else torch.cuda.current_device()
    return None


def _resolve(path: str) -> Callable | None:
    from ..kernels import HAS_TRITON

    if not HAS_TRITON:
        return None
    module, fn = path.split(":")
    return getattr(importlib.import_module(f"anygpu.kernels.{module}"), fn)


def define_op(schema: str, *, check: Callable, reference: Callable, fake: Callable, gpu: str | None = None,
              cpu: Callable | None = None, backward: Callable | None = None,
              setup_context: Callable | None = None) -> Op:
    name = schema.split("(", 1)[0].strip()
    qualname = f"{NAMESPACE}::{name}"
    torch.library.define(qualname, schema.split(name, 1)[1].strip(), lib=_LIB)

    on_cpu = cpu or reference

    @functools.wraps(on_cpu)
    def checked_cpu(*args):
        check(*args)
        return on_cpu(*args)

    def fake_impl(*args):
        check(*args)
        return fake(*args)

    torch.library.register_fake(qualname, fake_impl, lib=_LIB)
    torch.library.impl(qualname, "cpu", checked_cpu, lib=_LIB)

    @functools.lru_cache(maxsize=1)
    def kernel():
        k = _resolve(gpu) if gpu else None
        if k is None:
            warnings.warn(f"anygpu: {qualname} has no Triton kernel here (triton missing); using the PyTorch reference",
                          stacklevel=3)
        return k

    def gpu_impl(*args):
        check(*args)
        if _references_on(_gpu_index(args)):
            return reference(*args)
        return (kernel() or reference)(*args)

    torch.library.impl(qualname, "cuda", gpu_impl, lib=_LIB)
    if backward is not None:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_LIB)
    return Op(name, schema, reference, check, gpu, gpu_impl, checked_cpu)
