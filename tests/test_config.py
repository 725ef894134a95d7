import pytest

from anygpu.backend.targets import TARGETS
from anygpu.kernels.config import LaunchConfig, select


def test_amd_only_options_dropped_on_nvidia():
    cfg = LaunchConfig({"BLOCK": 64}, num_warps=8, num_stages=2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2)
    assert cfg.options(TARGETS["sm_90"]) == {"num_warps": 8, "num_stages": 2}
    assert cfg.options(TARGETS["gfx942"]) == {"num_warps": 8, "num_stages": 2, "waves_per_eu": 2,
                                              "matrix_instr_nonkdim": 16, "kpack": 2}
    # kpack is deprecated on gfx950 (Triton forces it to 1 with a warning): we do not pass it.
    assert "kpack" not in cfg.options(TARGETS["gfx950"])
    assert cfg.options(None) == {}  # the interpreter takes no compile options


def test_num_warps_capped_on_wave64():
    cfg = LaunchConfig(num_warps=32)
    assert cfg.options(TARGETS["gfx942"])["num_warps"] == 16  # 16 x 64 = 1024 threads
    assert cfg.options(TARGETS["gfx1100"])["num_warps"] == 32  # wave32: 32 x 32
    assert cfg.options(TARGETS["sm_90"])["num_warps"] == 32


def test_num_warps_must_be_power_of_two():
    with pytest.raises(ValueError, match="num_warps"):
        LaunchConfig(num_warps=6)


def test_select_most_specific_key():
    a, b, c, d = (LaunchConfig(num_warps=n) for n in (1, 2, 4, 8))
    table = {"default": (a,), "amd": (b,), "cdna3": (c,), "gfx950": (d,)}
    assert select(table, TARGETS["gfx950"]) == (d,)
    assert select(table, TARGETS["gfx942"]) == (c,)
    assert select(table, TARGETS["gfx1100"]) == (b,)
    assert select(table, TARGETS["sm_90"]) == (a,)
    assert select(table, None) == (a,)
    with pytest.raises(KeyError):
        select({"amd": (b,)}, TARGETS["sm_90"])
