"""Public ops.  Each op is one file: argument check, pure-PyTorch reference, fake, and the name of its
Triton kernel in ``anygpu.kernels``; ``define.define_op`` registers it as ``torch.ops.anygpu.<name>``.

Every module here but ``define`` and ``quant_common`` (what the quantization ops share) is an op file; each
is imported, and every ``Op`` it defines is exported under its name (``from anygpu.ops import silu_and_mul``).
Adding an op is adding a file.
"""

import importlib as _importlib
import pathlib as _pathlib

from .define import Op, define_op

OP_MODULES = tuple(sorted(p.stem for p in _pathlib.Path(__file__).parent.glob("*.py")
                          if p.stem not in ("__init__", "define", "quant_common") and not p.stem.startswith("_")))

# Every op, by name: the tests run opcheck and the reference comparison over this list.
ALL_OPS: dict[str, Op] = {}
for _module in OP_MODULES:
    for _value in vars(_importlib.import_module(f"{__name__}.{_module}")).values():
        if isinstance(_value, Op) and _value.name not in ALL_OPS:
            ALL_OPS[_value.name] = _value
globals().update(ALL_OPS)

__all__ = ["ALL_OPS", "OP_MODULES", "Op", "define_op", *ALL_OPS]
