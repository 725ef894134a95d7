"""Test setup.

The suite runs twice (see the Makefile): once with TRITON_INTERPRET=1, where Triton kernels run on the
CPU in the interpreter, and once without, for the cross-compile tests (marked ``aot``), which need real
@triton.jit functions.  Triton decides between the two when a kernel is decorated, at import time, so
one process cannot do both.  On a GPU machine run without TRITON_INTERPRET: kernels run on the GPU.
"""

import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Tests compare the default GGUF model with transformers' fp32 logits, so the engine keeps its projections
# dequantized to fp32 here; tests/test_gguf_int4pack.py runs the packed CPU path (the product's default).
os.environ.setdefault("ANYGPU_CPU_GGUF_PACKED", "0")


def pytest_collection_modifyitems(config, items):
    skip_aot = pytest.mark.skip(reason="cross-compilation needs a process without TRITON_INTERPRET=1")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm GPU")
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "aot" in item.keywords and INTERPRET:
            item.add_marker(skip_aot)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_sessionfinish(session, exitstatus):
    """Reap child processes a test left behind.  multiprocessing joins every non-daemon child at interpreter
    exit, so one leaked child (a spawn whose start never completed: it waits forever for its start data) hung
    the whole run after its summary line.  Each is named, by the test it was spawned in, and ended."""
    import multiprocessing

    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/environ", "rb") as f:
                spawned_in = [v for v in f.read().split(b"\0") if v.startswith(b"PYTEST_CURRENT_TEST=")]
        except OSError:
            spawned_in = []
        where = spawned_in[0].decode(errors="replace").split("=", 1)[1] if spawned_in else "an unknown test"
        warnings.warn(f"child process {child.pid} ({child.name}) left alive by {where}: terminated")
        child.terminate()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)


@pytest.fixture
def kdevice():
    """The device Triton kernels run on in this process (GPU, or CPU under the interpreter)."""
    from anygpu.testing import kernel_device

    dev = kernel_device()
    if dev is None:
        pytest.skip("no GPU and TRITON_INTERPRET is not set: Triton kernels cannot run here")
    return dev


@pytest.fixture
def fresh_backend(monkeypatch):
    """Forget the cached backend choice before and after a test that changes what detection sees."""
    import anygpu.backend as backend

    backend.reset()
    yield backend
    backend.reset()
