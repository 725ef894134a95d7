"""Backend detection and device description, with ROCm and CUDA faked on the CPU."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from anygpu.backend import BackendUnavailable, choose, cpu, cuda, rocm
from anygpu.backend.visible import conflict_message, hidden_message


@pytest.fixture
def fake_torch(monkeypatch):
    """Make this CPU torch look like a ROCm or CUDA build with n visible GPUs."""

    def apply(build: str, n: int):
        monkeypatch.setattr(torch.version, "hip", "6.4.43482" if build == "rocm" else None)
        monkeypatch.setattr(torch.version, "cuda", "12.8" if build == "cuda" else None)
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: build != "cpu")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return apply


def mi300x(**over):
    props = dict(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", warp_size=64,
                 multi_processor_count=304, total_memory=192 * 2**30, shared_memory_per_block=65536, major=9, minor=4)
    props.update(over)
    return SimpleNamespace(**props)


def test_rocm_chosen_when_hip_build_sees_gpus(fake_torch):
    fake_torch("rocm", 8)
    c = choose(env={})
    assert c.name == "rocm" and "ROCm build" in c.reason
    assert not c.found["cuda"][0]


def test_cuda_chosen_when_cuda_build_sees_gpus(fake_torch):
    fake_torch("cuda", 1)
    assert choose(env={}).name == "cuda"


def test_cpu_when_gpu_build_sees_none_names_the_variable(fake_torch, monkeypatch):
    fake_torch("rocm", 0)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    c = choose(env={})
    assert c.name == "cpu"
    assert "HIP_VISIBLE_DEVICES=''" in c.reason and "no GPU is visible" in c.reason


def test_override(fake_torch):
    fake_torch("rocm", 2)
    assert choose(env={"ANYGPU_BACKEND": "cpu"}).name == "cpu"
    assert choose(env={"ANYGPU_BACKEND": " ROCm "}).name == "rocm"
    with pytest.raises(BackendUnavailable, match=r"ANYGPU_BACKEND=cuda but .*ROCm build.*found here is 'rocm'"):
        choose(env={"ANYGPU_BACKEND": "cuda"})


def test_override_unavailable_on_cpu_build(fake_torch):
    fake_torch("cpu", 0)
    with pytest.raises(BackendUnavailable, match="ANYGPU_BACKEND=rocm but .*CPU-only build.*found here is 'cpu'"):
        choose(env={"ANYGPU_BACKEND": "rocm"})


def test_override_rejects_unknown_name():
    with pytest.raises(ValueError, match="ANYGPU_BACKEND='metal': expected one of rocm, cuda, cpu"):
        choose(env={"ANYGPU_BACKEND": "metal"})


def test_describe_mi300x():
    b = rocm.describe(0, props=mi300x())
    assert (b.name, b.arch, b.raw_arch, b.warp_size) == ("rocm", "gfx942", "gfx942:sramecc+:xnack-", 64)
    assert b.device == torch.device("cuda", 0)  # torch reuses the cuda namespace on ROCm
    assert b.fp8_dtypes == (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    assert b.fp8_e4m3 == torch.float8_e4m3fnuz
    assert b.shared_memory_per_block == 65536 and b.multiprocessor_count == 304


def test_describe_mi355x_uses_ocp_fp8():
    b = rocm.describe(0, props=mi300x(name="AMD Instinct MI355X", gcnArchName="gfx950:sramecc+:xnack-",
                                      shared_memory_per_block=160 * 1024))
    assert b.fp8_e4m3 == torch.float8_e4m3fn and b.shared_memory_per_block == 160 * 1024


def test_describe_rdna3_without_warp_size_field_is_wave32():
    props = mi300x(name="Radeon RX 7900 XTX", gcnArchName="gfx1100", multi_processor_count=48)
    del props.warp_size  # torch < 2.5 has no warp_size: the arch decides, never "ROCm means 64"
    b = rocm.describe(0, props=props)
    assert b.warp_size == 32 and b.fp8_dtypes == () and b.target.family == "rdna3"


def test_describe_rejects_garbage_arch():
    with pytest.raises(ValueError, match="gcnArchName"):
        rocm.describe(0, props=mi300x(gcnArchName=""))


def test_describe_cuda_h200():
    props = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, total_memory=141 * 10**9,
                            warp_size=32, shared_memory_per_block_optin=232448)
    b = cuda.describe(0, props=props)
    assert (b.arch, b.warp_size, b.fp8_e4m3) == ("sm_90", 32, torch.float8_e4m3fn)


def test_rocm_blas_version_from_library():
    class FakeLib:
        def rocblas_get_version_string_size(self, size_ptr):
            size_ptr._obj.value = 16
            return 0

        def rocblas_get_version_string(self, buf, size):
            buf.value = b"4.3.0.abcdef"
            return 0

    def loader(name):
        if name != "librocblas.so":
            raise OSError(name)
        return FakeLib()

    assert rocm.rocblas_version_from_library(loader) == "4.3.0.abcdef"
    assert rocm.rocblas_version_from_library(lambda n: (_ for _ in ()).throw(OSError(n))) is None


def test_visible_device_messages():
    assert "HIP_VISIBLE_DEVICES=''" in hidden_message({"HIP_VISIBLE_DEVICES": ""}, "rocm")
    assert "ROCR_VISIBLE_DEVICES='-1'" in hidden_message({"ROCR_VISIBLE_DEVICES": "-1"}, "rocm")
    assert hidden_message({"HIP_VISIBLE_DEVICES": ""}, "cuda") is None  # CUDA does not read HIP's variable
    assert "CUDA_VISIBLE_DEVICES" in hidden_message({"CUDA_VISIBLE_DEVICES": "-1,0"}, "cuda")
    assert hidden_message({"CUDA_VISIBLE_DEVICES": "0,1"}, "cuda") is None
    assert "disagree" in conflict_message({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"})
    assert conflict_message({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"}) is None


def test_cpu_backend_description():
    b = cpu.describe()
    assert b.name == "cpu" and not b.is_gpu and b.total_memory > 0 and b.multiprocessor_count >= 1
    assert b.versions["torch"] == torch.__version__


_NO_INIT = """
import anygpu.backend as b, torch
name = b.name()
print(name, torch.cuda.is_initialized())
"""


def test_asking_the_backend_does_not_initialise_the_gpu_runtime():
    out = subprocess.run([sys.executable, "-c", _NO_INIT], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "ANYGPU_BACKEND"})
    name, initialised = out.stdout.split()
    assert name in ("rocm", "cuda", "cpu") and initialised == "False"


_FORK = """
import os, torch, anygpu.backend as b
assert b.name() in ("cuda", "rocm")
pid = os.fork()
if pid == 0:
    x = torch.ones(4, device="cuda") * 2
    os._exit(0 if float(x.sum()) == 8.0 else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.gpu
def test_gpu_usable_in_a_child_forked_after_detection():
    out = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0", out.stderr


@pytest.mark.gpu
def test_real_gpu_description(fresh_backend):
    b = fresh_backend.current()
    assert b.is_gpu and b.total_memory > 0 and b.warp_size in (32, 64)
    assert b.target is not None and b.arch == b.target.arch
    assert "torch" in b.versions and ("cuda_runtime" in b.versions or "hip_runtime" in b.versions)
