"""``ops.linear`` and its one-row GEMV (``kernels/gemv.py``): the GEMV equals fp32 products and sums rounded once
(within the fp32 summation order) for fp16 and bf16, with and without bias, K and N off the tile sizes, both
configs; everything else is ``F.linear`` exactly; bad arguments name themselves; autograd is F.linear's.  The
kernel runs in Triton's interpreter here, on the GPU where there is one.

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/test_gemv.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anygpu import ops
from anygpu.kernels import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

# The last two reach the wide-layer config: its MIN_N lowered to WIDE_FROM by ``small_wide_class``, so the
# interpreter need not walk 16k rows to run it.
WIDE_FROM = 64
CASES = [(40, 1024, True), (37, 1000, False), (8, 512, True), (WIDE_FROM + 24, 512, False), (WIDE_FROM + 16, 300, True)]


@pytest.fixture
def small_wide_class(monkeypatch):
    """The GEMV's config table with every wide-layer class starting at WIDE_FROM rows (the same tiles)."""
    import dataclasses

    from anygpu.kernels import gemv as G

    table = {key: tuple(dataclasses.replace(c, constexprs={**c.constexprs, "MIN_N": min(c.constexprs["MIN_N"],
                                                                                         WIDE_FROM)})
                        for c in configs) for key, configs in G.CONFIGS.items()}
    monkeypatch.setattr(G, "CONFIGS", table)
    assert G.config(WIDE_FROM, torch.device("cpu")).constexprs["BLOCK_N"] == 16  # the wide tiles
    assert G.config(WIDE_FROM - 1, torch.device("cpu")).constexprs["BLOCK_N"] == 8


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of the dtype's spacing at |want| (fp32 want, 16-bit got)."""
    eps = torch.finfo(got.dtype).eps
    spacing = torch.exp2(torch.floor(torch.log2(torch.clamp(want.abs(), min=1.0)))) * eps
    return ((got.float() - want) / spacing).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", CASES)
def test_gemv_is_the_fp32_product_rounded_once(kdevice, small_wide_class, dtype, n, k, bias):
    from anygpu.kernels.gemv import gemv

    device = kdevice
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    got = gemv(x, w, b)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.shape == (1, n) and got.dtype == dtype
    # Rounded once from an fp32 sum: within a unit of the dtype (half on GPUs; Triton's interpreter rounds bf16
    # toward zero), plus fp32's error over K terms.
    assert _ulps(got, want.float()) <= 1.0 + k * 2 ** -24 / torch.finfo(dtype).eps * 4
    assert torch.equal(gemv(x[0], w, b), got[0])  # a [K] vector gives [N]


def test_the_gpu_path_is_f_linear_for_anything_but_one_16bit_row(kdevice):
    from anygpu.kernels.gemv import gemv, linear

    device = kdevice
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 64, generator=g).to(device)
    for x in (torch.randn(3, 64, generator=g), torch.randn(1, 64, generator=g), torch.randn(2, 1, 64, generator=g)):
        x = x.to(device)
        assert torch.equal(linear(x, w, None), F.linear(x, w))  # several rows, or fp32: the vendor GEMM
    wb, xb = w.bfloat16(), torch.randn(1, 64, generator=g).bfloat16().to(device)
    assert torch.equal(linear(xb, wb, None), gemv(xb, wb, None))
    strided = torch.randn(1, 128, generator=g).bfloat16().to(device)[:, ::2]
    assert torch.equal(linear(strided, wb, None), F.linear(strided, wb))


def test_op_on_the_cpu_is_f_linear_and_checks_its_arguments():
    x, w, b = torch.randn(2, 5, 8), torch.randn(3, 8), torch.randn(3)
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))
    with pytest.raises(ValueError, match="weight: expected"):
        ops.linear(x, torch.randn(3, 7), None)
    with pytest.raises(ValueError, match="weight: expected"):
        ops.linear(x, w.double(), None)
    with pytest.raises(ValueError, match="bias: expected"):
        ops.linear(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="x: expected"):
        ops.linear(x.int(), w, None)
    with pytest.raises(TypeError, match="weight"):
        ops.linear(x, [[1.0]], None)


def test_autograd_is_f_linear_s():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    ops.linear(x, w, b).pow(2).sum().backward()
    got = (x.grad, w.grad, b.grad)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.linear(x2, w2, b2).pow(2).sum().backward()
    for a, e in zip(got, (x2.grad, w2.grad, b2.grad)):
        torch.testing.assert_close(a, e)


def test_meta_tensors_take_the_fake():
    out = ops.linear(torch.empty(2, 8, device="meta"), torch.empty(5, 8, device="meta"), None)
    assert out.shape == (2, 5) and out.device.type == "meta"


def test_opcheck():
    x, w, b = torch.randn(2, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True), torch.randn(3)
    torch.library.opcheck(ops.linear.overload, (x, w, b))
    torch.library.opcheck(ops.linear.overload, (x.detach(), w.detach(), None))
