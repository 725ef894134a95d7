import pytest
import torch

from anygpu.backend.targets import CI_TARGETS, TARGETS, cuda_arch, lookup, parse_gcn_arch, parse_target_list

REQUIRED = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201", "sm_80", "sm_89", "sm_90", "sm_100")


def test_table_has_required_targets():
    assert set(REQUIRED) <= set(TARGETS)
    assert set(CI_TARGETS) <= set(TARGETS)


@pytest.mark.parametrize("raw,arch", [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx90a:sramecc-:xnack+", "gfx90a"),
                                      ("gfx1100", "gfx1100"), ("GFX950", "gfx950"), (" gfx1201 ", "gfx1201")])
def test_parse_gcn_arch(raw, arch):
    assert parse_gcn_arch(raw) == arch


@pytest.mark.parametrize("bad", ["", "sm_90", "gfx", "gfx94:xnack", "amdgcn-gfx942", "gfx94g"])
def test_parse_gcn_arch_rejects(bad):
    with pytest.raises(ValueError, match="gcnArchName"):
        parse_gcn_arch(bad)


@pytest.mark.parametrize("arch,wave", [("gfx90a", 64), ("gfx942", 64), ("gfx950", 64), ("gfx1100", 32),
                                       ("gfx1201", 32), ("sm_90", 32)])
def test_wave_size(arch, wave):
    assert TARGETS[arch].warp_size == wave
    # num_warps counts wavefronts: at most 1024 threads per program.
    assert TARGETS[arch].max_num_warps * wave == 1024


def test_fp8_flavours():
    assert TARGETS["gfx942"].fp8_dtypes() == (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    assert TARGETS["gfx942"].fp8_fnuz
    for arch in ("gfx950", "gfx1201", "sm_89", "sm_90", "sm_100"):
        assert TARGETS[arch].fp8_dtypes() == (torch.float8_e4m3fn, torch.float8_e5m2), arch
        assert not TARGETS[arch].fp8_fnuz
    for arch in ("gfx90a", "gfx1100", "sm_80"):
        assert TARGETS[arch].fp8_dtypes() == ()


def test_lds_limits():
    assert TARGETS["gfx942"].shared_per_block == 64 * 1024
    assert TARGETS["gfx950"].shared_per_block == 160 * 1024
    assert TARGETS["gfx1100"].shared_per_block == 64 * 1024
    assert TARGETS["sm_90"].shared_per_block == 227 * 1024
    # CUDA guide, opt-in per block: Ada and consumer Blackwell 99 KiB, data-center Blackwell 227 KiB.
    assert TARGETS["sm_89"].shared_per_block == TARGETS["sm_120"].shared_per_block == 99 * 1024
    assert TARGETS["sm_100"].shared_per_block == 227 * 1024
    assert TARGETS["gfx908"].shared_per_block == 64 * 1024 and TARGETS["gfx908"].warp_size == 64


def test_lookup_unknown_arch_is_guessed_and_marked():
    t = lookup("gfx1030")
    assert not t.known and t.warp_size == 32 and t.vendor == "amd" and t.matrix_unit == "none" and t.family == "rdna2"
    assert lookup("gfx1010").family == "rdna1" and lookup("gfx1151").family == "rdna3"
    t = lookup("gfx906")
    assert not t.known and t.warp_size == 64
    # Unknown NVIDIA parts get limits every GPU since Volta meets (a T4, sm_75, has 64 KiB per SM).
    t = lookup("sm_75")
    assert not t.known and t.shared_per_block == 48 * 1024 and t.max_threads_per_cu == 1024 and t.fp8 == ()
    t = lookup("sm_121")
    assert not t.known and t.shared_per_block <= 99 * 1024 and t.fp8_dtypes()[0] == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="arch"):
        lookup("tpu_v5")


def test_lookup_normalises_names():
    assert lookup("sm_90a") is TARGETS["sm_90"] and lookup("SM_90") is TARGETS["sm_90"]
    assert lookup(" GFX942 ") is TARGETS["gfx942"]


def test_triton_target_of_each_row():
    pytest.importorskip("triton")
    assert TARGETS["gfx942"].triton_target().backend == "hip"
    assert TARGETS["gfx942"].triton_target().arch == "gfx942"
    assert TARGETS["sm_90"].triton_target().arch == 90


def test_parse_target_list():
    assert [t.arch for t in parse_target_list("ci")] == list(CI_TARGETS)
    assert [t.arch for t in parse_target_list("gfx942, sm_90")] == ["gfx942", "sm_90"]
    assert len(parse_target_list("all")) == len(TARGETS)


def test_cuda_arch():
    assert cuda_arch(9, 0) == "sm_90" and cuda_arch(10, 0) == "sm_100"


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(arch=st.sampled_from([a for a in TARGETS if a.startswith("gfx")]),
       features=st.lists(st.sampled_from(["sramecc+", "sramecc-", "xnack+", "xnack-"]), max_size=2))
def test_parse_gcn_arch_strips_any_feature_suffix(arch, features):
    assert parse_gcn_arch(":".join([arch, *features])) == arch
