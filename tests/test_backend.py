"""Backend detection and device description, with ROCm and CUDA faked on the CPU."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from anygpu.backend import BackendUnavailable, choose, cpu, cuda, rocm
from anygpu.backend.visible import (
    amd_kfd_gpus,
    conflict_message,
    count_gpus,
    hidden_message,
    nvidia_driver_gpus,
    visible_count,
)


@pytest.fixture
def fake_torch(monkeypatch):
    """Make this CPU torch look like a ROCm or CUDA build with n visible GPUs."""

    def apply(build: str, n: int):
        monkeypatch.setattr(torch.version, "hip", "6.4.43482" if build == "rocm" else None)
        monkeypatch.setattr(torch.version, "cuda", "12.8" if build == "cuda" else None)
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: build != "cpu")
        # NVML / amdsmi answer (they apply the visible-device variables themselves).
        monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: n if build == "cuda" else -1)
        monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: n if build == "rocm" else -1)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("detection used the GPU runtime"))

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


def test_cpu_when_gpu_build_sees_none_names_the_variable(fake_torch):
    fake_torch("rocm", 0)
    c = choose(env={"HIP_VISIBLE_DEVICES": ""})
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
    # On ROCm a set HIP_VISIBLE_DEVICES wins: an empty CUDA_VISIBLE_DEVICES beside it is ignored.
    assert hidden_message({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": ""}, "rocm") is None
    assert "HIP_VISIBLE_DEVICES wins" in conflict_message({"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"})
    assert conflict_message({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"}) is None


@pytest.mark.parametrize("env,backend,physical,count", [
    ({}, "cuda", 4, 4),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, "cuda", 4, 2),
    ({"CUDA_VISIBLE_DEVICES": "1,7,0"}, "cuda", 4, 1),  # CUDA stops at the first invalid index
    ({"CUDA_VISIBLE_DEVICES": "2,2"}, "cuda", 4, 1),
    ({"CUDA_VISIBLE_DEVICES": "GPU-5f3c,GPU-9a1b"}, "cuda", 4, 2),
    ({"CUDA_VISIBLE_DEVICES": "7"}, "cuda", 1, 0),  # an index past the last GPU hides it
    ({"ROCR_VISIBLE_DEVICES": "0,1,2", "HIP_VISIBLE_DEVICES": "1"}, "rocm", 8, 1),
    ({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0"}, "rocm", 8, 2),
    ({"CUDA_VISIBLE_DEVICES": "0"}, "rocm", 8, 1),
])
def test_visible_count(env, backend, physical, count):
    assert visible_count(env, backend, physical) == count


def test_count_gpus_prefers_library_then_driver_then_runtime():
    def runtime():
        raise AssertionError("runtime asked although another way could count")

    assert count_gpus("cuda", {}, lambda: 2, lambda: 8, runtime) == (2, "library")
    assert count_gpus("cuda", {"CUDA_VISIBLE_DEVICES": "3"}, lambda: -1, lambda: 8, runtime) == (1, "driver")
    assert count_gpus("rocm", {}, lambda: -1, lambda: None, lambda: 5) == (5, "runtime")


def test_driver_listings(tmp_path):
    gpus = tmp_path / "gpus"
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (gpus / bus).mkdir(parents=True)
    assert nvidia_driver_gpus(str(gpus)) == 2
    assert nvidia_driver_gpus(str(tmp_path / "absent")) is None
    nodes = tmp_path / "nodes"
    for i, version in enumerate((0, 90402, 90402)):  # node 0 is the CPU
        (nodes / str(i)).mkdir(parents=True)
        (nodes / str(i) / "properties").write_text(f"cpu_cores_count 0\ngfx_target_version {version}\nsimd_count 1216\n")
    assert amd_kfd_gpus(str(nodes)) == 2
    assert amd_kfd_gpus(str(tmp_path / "absent")) is None


def test_cpu_backend_description():
    b = cpu.describe()
    assert b.name == "cpu" and not b.is_gpu and b.total_memory > 0 and b.multiprocessor_count >= 1
    assert b.versions["torch"] == torch.__version__


_NO_INIT = """
import torch

def runtime_count():
    raise SystemExit("detection asked the GPU runtime for the device count (initialises it)")

torch._C._cuda_getDeviceCount = runtime_count
import anygpu.backend as b
name = b.name()
print(name, torch.cuda.is_initialized(), b.module(name).count_devices()[1] if name != "cpu" else "-")
"""


def test_asking_the_backend_does_not_initialise_the_gpu_runtime():
    out = subprocess.run([sys.executable, "-c", _NO_INIT], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "ANYGPU_BACKEND"})
    assert out.returncode == 0, out.stdout + out.stderr
    name, initialised, how = out.stdout.split()
    assert name in ("rocm", "cuda", "cpu") and initialised == "False" and how in ("library", "driver", "-")


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
