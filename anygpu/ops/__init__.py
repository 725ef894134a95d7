"""Public ops.  Each op is one file: argument check, pure-PyTorch reference, fake, and the name of its
Triton kernel in ``anygpu.kernels``; ``define.define_op`` registers it as ``torch.ops.anygpu.<name>``.
"""

from .define import Op, define_op
from .silu_and_mul import silu_and_mul

# Every op, by name: the tests run opcheck and the reference comparison over this list.
ALL_OPS = {op.name: op for op in (silu_and_mul,)}

__all__ = ["ALL_OPS", "Op", "define_op", "silu_and_mul"]
