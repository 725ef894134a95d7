import pytest

from anygpu.backend.targets import TARGETS
from anygpu.kernels.launch import LaunchConfig, select


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


def test_launch_config_on_faked_rocm_devices(monkeypatch):
    """Config selection end to end: faked device properties -> Backend -> target -> config and options."""
    import torch

    import anygpu.backend as backend
    from anygpu.backend import rocm
    from anygpu.kernels import launch as kconfig
    from tests.test_backend import mi300x

    table = {"default": (LaunchConfig({"B": 1}, num_warps=32),),
             "cdna3": (LaunchConfig({"B": 3}, num_warps=32, waves_per_eu=1, matrix_instr_nonkdim=16),)}
    devices = {0: rocm.describe(0, props=mi300x()),
               1: rocm.describe(1, props=mi300x(name="Radeon RX 7900 XTX", gcnArchName="gfx1100", warp_size=32))}
    monkeypatch.setattr(backend, "describe_gpu", lambda index: devices[index])
    monkeypatch.setattr(kconfig, "_LAUNCH_CACHE", {})
    cfg, opts = kconfig.launch_config(table, torch.device("cuda", 0))
    assert cfg.constexprs == {"B": 3}
    assert opts == {"num_warps": 16, "waves_per_eu": 1, "matrix_instr_nonkdim": 16}  # wave64: 16 x 64 threads
    cfg, opts = kconfig.launch_config(table, torch.device("cuda", 1))
    assert cfg.constexprs == {"B": 1} and opts == {"num_warps": 32}  # RDNA3 is wave32
    assert kconfig.launch_config(table, torch.device("cpu")) == (table["default"][0], {})  # the interpreter


def test_quantized_gemm_configs_take_the_weight_shape():
    """The 64-row bucket's gate/up entries (NVIDIA) are taken for that shape only: for the 4-bit GEMM one for
    K-quant blocks of 32 and one for larger blocks (NF4's 64), for the int8-block one any block; other shapes and
    fewer rows keep the general entries, and a call without a shape gets the bucket's general entry."""
    import torch

    from anygpu.kernels import matmul_4bit as K4
    from anygpu.kernels import matmul_int8_block as K8

    sm90 = TARGETS["sm_90"]
    gate_up = K4.gemm_config(64, sm90, 28672, 4096, 32).constexprs
    assert (gate_up["MIN_N"], gate_up["BLOCK_K"], gate_up["SPLIT_K"]) == (16384, 64, 2)
    nf4_gate_up = K4.gemm_config(64, sm90, 28672, 4096, 64).constexprs
    assert (nf4_gate_up["MIN_N"], nf4_gate_up["BLOCK_N"], nf4_gate_up["SPLIT_K"]) == (16384, 128, 1)
    for args in [(64, sm90, 4096, 14336, 32), (64, sm90, 4096, 14336, 64), (64, sm90, 28672, 8192, 64), (64, sm90)]:
        c = K4.gemm_config(*args).constexprs
        assert "MIN_N" not in c and (c["MAX_M"], c["BLOCK_K"], c["SPLIT_K"]) == (64, 128, 4), args
    assert K4.gemm_config(16, sm90, 28672, 4096, 32).constexprs["MAX_M"] == 16
    assert K4.plan(64, 28672, 4096, 32, torch.bfloat16, torch.device("cpu")).config.constexprs.get("MIN_N") is None

    c8 = K8.gemm_config(64, sm90, 28672, 4096).constexprs
    assert (c8["MIN_N"], c8["SPLIT_K"]) == (16384, 1)
    for args in [(64, sm90, 6144, 4096), (64, sm90)]:
        assert "MIN_N" not in K8.gemm_config(*args).constexprs, args
    assert K8.gemm_config(32, sm90, 28672, 4096).constexprs["MAX_M"] == 32
