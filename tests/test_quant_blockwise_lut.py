"""8-bit blockwise quantize: the bucket-table search (``kernels/code_lut.py``, used for maps it can serve, such
as bitsandbytes' dynamic maps) and the search tree (any other sorted map) both bit-identical to the reference,
special values included."""

import pytest
import torch

from anygpu.ops.quantize_blockwise import reference as quantize_blockwise_reference
from anygpu.quant import create_dynamic_map


def _codes(kdevice, x, code, blocksize):
    from anygpu.kernels.quant_blockwise import device_lut, quantize_blockwise

    codes, absmax = quantize_blockwise(x, code, blocksize)
    ref_codes, ref_absmax = quantize_blockwise_reference(x, code, blocksize)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(absmax.view(torch.int32), ref_absmax.view(torch.int32))
    return device_lut(code)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_maps_take_the_table_and_match(kdevice, signed):
    code = create_dynamic_map(signed=signed).to(kdevice)
    x = torch.randn(40, 256, device=kdevice) * torch.logspace(-8, 2, 40, device=kdevice)[:, None]
    specials = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3.0, -3.0],
                            device=kdevice)
    x[1, :9] = specials
    x[2] = 0.0  # an all-zero block
    x[3, 5] = -7.0  # a negative absmax element
    mids = (code[:-1] + code[1:]) / 2  # values landing exactly on midpoints and one float either side
    x[4, :255] = mids * 7.0
    x[4, 255] = 7.0
    assert _codes(kdevice, x.reshape(-1), code, 256) is not None


def test_a_map_the_table_cannot_serve_takes_the_tree(kdevice):
    code = torch.sort(torch.cat([torch.linspace(-1, 1, 254), torch.tensor([0.5000001, 0.5000002])])).values
    code = code.to(kdevice)
    x = torch.randn(4096, device=kdevice)
    assert _codes(kdevice, x, code, 64) is None  # two midpoints in one bucket: the tree, and still exact


@pytest.mark.parametrize("keyed", [False, True])  # the optimizers' compact form, quantize's keyed form
@pytest.mark.parametrize("sign_fix", [True, False])
def test_tables_of_the_dynamic_maps_are_proven_for_both_rules(sign_fix, keyed):
    from anygpu.kernels.code_lut import KEYED_SIZE, build_search_table, lut_codes, reference_codes

    code = create_dynamic_map(signed=True)
    lut = build_search_table(code, signed=True, sign_fix=sign_fix, keyed=keyed)
    assert lut is not None and (lut.numel() == KEYED_SIZE) == keyed
    x = torch.cat([torch.linspace(-1, 1, 100_001), torch.tensor([-0.0, 0.0, 1e-30, -1e-30])])
    assert torch.equal(lut_codes(x, lut, True), reference_codes(x, code, True, sign_fix))
    # the two rules differ (the sign fix moves codes of small negative values), so neither table serves the other
    other = build_search_table(code, signed=True, sign_fix=not sign_fix, keyed=keyed)
    assert not torch.equal(lut, other)


def test_keyed_table_serves_signed_maps_only_and_refuses_what_the_compact_one_refuses():
    from anygpu.kernels.code_lut import build_search_table

    with pytest.raises(ValueError, match="keyed"):
        build_search_table(create_dynamic_map(signed=False), signed=False, keyed=True)
    assert build_search_table(torch.linspace(-1, 1, 256), True, keyed=True) is None  # a midpoint at 0
    assert build_search_table(create_dynamic_map(signed=True) + 1e-3, True, keyed=True) is None  # no +0.0


def test_cached_per_tensor_keeps_live_entries_and_remembers_no_uncached_answer():
    from anygpu.kernels.code_lut import UNCACHED, cached_per_tensor

    cache, builds = {}, []
    live = [torch.zeros(2) for _ in range(3)]
    for t in live:
        assert cached_per_tensor(cache, t, id(t), lambda: builds.append(1) or "v", limit=4) == "v"
    dead = torch.zeros(2)
    cached_per_tensor(cache, dead, id(dead), lambda: "d", limit=4)
    del dead
    extra = torch.zeros(2)
    cached_per_tensor(cache, extra, id(extra), lambda: "e", limit=4)  # full: the dead entry makes room
    assert len(cache) == 4 and all(cached_per_tensor(cache, t, id(t), lambda: "rebuilt", limit=4) == "v" for t in live)
    assert len(builds) == 3
    other = torch.zeros(2)
    assert cached_per_tensor(cache, other, id(other), lambda: UNCACHED) is None and id(other) not in cache
