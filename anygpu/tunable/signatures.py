"""GEMM problem keys: the tuple the hot path looks up, and PyTorch TunableOp's strings for the file.

PyTorch names a GEMM the way it calls BLAS (column-major): a row-major ``C[M, N] = A[M, K] @ B[K, N]``
is computed as ``C^T = B^T @ A^T``, so BLAS's m is our N, its first operand is our B, and
``F.linear(x[tokens, K], W[N, K])`` is ``GemmTunableOp_<T>_TN,tn_<N>_<tokens>_<K>_ld_<K>_<K>_<N>``.
We use the same strings so a PyTorch file's keys are ours (its solutions mostly are not: see ops.py).

The tuple ``Problem`` is built from sizes and strides only (no string formatting on the hot path);
strings are made on a miss, and file lines are parsed back into the same tuples.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "Half", torch.bfloat16: "BFloat16"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
FAMILIES = ("Gemm", "GemmAndBias", "GemmStridedBatched")


class Problem(NamedTuple):
    family: str  # "Gemm" | "GemmAndBias" | "GemmStridedBatched"
    dtype: torch.dtype
    trans_a: str  # BLAS transposes, "n" | "t", of BLAS's A (our B) and B (our A)
    trans_b: str
    m: int  # BLAS order: m = our N (output features), n = our M (tokens)
    n: int
    k: int
    batch: int  # 1 unless GemmStridedBatched
    lda: int
    ldb: int
    ldc: int

    def op_signature(self) -> str:
        return f"{self.family}TunableOp_{DTYPE_NAMES[self.dtype]}_{self.trans_a.upper()}{self.trans_b.upper()}"

    def params_signature(self) -> str:
        head = f"{self.trans_a}{self.trans_b}_{self.m}_{self.n}_{self.k}"
        batch = f"_B_{self.batch}" if self.family == "GemmStridedBatched" else ""
        return f"{head}{batch}_ld_{self.lda}_{self.ldb}_{self.ldc}"

    @property
    def tokens(self) -> int:
        return self.n


def blas_operand(stride_rows: int, stride_cols: int, rows: int) -> tuple[str, int]:
    """BLAS transpose and leading dimension of a row-major-math operand with these strides.

    Row-major (stride_cols == 1) is a column-major transpose-free operand of BLAS's swapped product;
    column-major (stride_rows == 1) needs "t".  Anything else torch copies first: keyed as contiguous."""
    if stride_cols == 1 and (stride_rows >= 1 or rows == 1):
        return "n", stride_rows
    if stride_rows == 1:
        return "t", stride_cols
    return "n", -1


def _problem(family, dtype, a_strides, a_rows, b_strides, b_rows, m, n, k, batch) -> Problem:
    # Our C[M, N] = A[M, K] @ B[K, N]; BLAS's A is our B (k x n... in its terms m x k), its B is our A.
    ta, lda = blas_operand(b_strides[0], b_strides[1], b_rows)
    tb, ldb = blas_operand(a_strides[0], a_strides[1], a_rows)
    if lda == -1:
        ta, lda = "n", n
    if ldb == -1:
        tb, ldb = "n", k
    # Degenerate leading dimensions (a single row): what a contiguous operand would have.
    if lda < 1 or (ta == "n" and lda < n) or (ta == "t" and lda < k):
        lda = n if ta == "n" else k
    if ldb < 1 or (tb == "n" and ldb < k) or (tb == "t" and ldb < m):
        ldb = k if tb == "n" else m
    return Problem(family, dtype, ta, tb, n, m, k, batch, lda, ldb, n)


def linear_problem(x: torch.Tensor, weight: torch.Tensor, has_bias: bool) -> Problem:
    """``F.linear(x, weight)``: our A = x flattened to [M, K], our B = weight^T."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if x.dim() == 2:
        xs = (x.stride(0), x.stride(1))
    else:
        xs = (k, 1) if x.is_contiguous() else (-1, -1)
    return _problem("GemmAndBias" if has_bias else "Gemm", x.dtype, xs, m,
                    (weight.stride(1), weight.stride(0)), k, m, weight.shape[0], k, 1)


def mm_problem(a: torch.Tensor, b: torch.Tensor) -> Problem:
    m, k = a.shape
    return _problem("Gemm", a.dtype, a.stride(), m, b.stride(), k, m, b.shape[1], k, 1)


def bmm_problem(a: torch.Tensor, b: torch.Tensor) -> Problem:
    batch, m, k = a.shape
    return _problem("GemmStridedBatched", a.dtype, a.stride()[1:], m, b.stride()[1:], k, m, b.shape[2], k, batch)


_OP_RE = re.compile(r"^(Gemm|GemmAndBias|GemmStridedBatched)TunableOp_(\w+?)_([NT])([NT])$")
_PARAMS_RE = re.compile(r"^([nt])([nt])_(\d+)_(\d+)_(\d+)(?:_B_(\d+))?(?:_ld_(\d+)_(\d+)_(\d+))?$")


def parse_signatures(op_signature: str, params_signature: str) -> Problem | None:
    """The ``Problem`` a file line names, or None for ops we do not tune (scaled GEMMs, complex, fp8 ...)."""
    op = _OP_RE.match(op_signature)
    params = _PARAMS_RE.match(params_signature)
    if not op or not params or op[2] not in NAME_DTYPES:
        return None
    family, dtype = op[1], NAME_DTYPES[op[2]]
    ta, tb = params[1], params[2]
    if (op[3].lower(), op[4].lower()) != (ta, tb):
        return None
    m, n, k = int(params[3]), int(params[4]), int(params[5])
    batch = int(params[6]) if params[6] else 1
    if (family == "GemmStridedBatched") != bool(params[6]):
        return None
    if params[7]:
        lda, ldb, ldc = int(params[7]), int(params[8]), int(params[9])
    else:  # PyTorch < 2.6 wrote no leading dimensions: those of contiguous operands
        lda, ldb, ldc = (m if ta == "n" else k), (k if tb == "n" else n), m
    return Problem(family, dtype, ta, tb, m, n, k, batch, lda, ldb, ldc)
