import gc

import pytest
import torch

import anygpu
from anygpu import backend


@pytest.fixture(autouse=True)
def restore_limits():
    import anygpu.backend.memory as m

    saved = (m._memory_limit, m._cache_limit)
    yield
    m._memory_limit, m._cache_limit = saved
    if backend.is_gpu():
        backend.module().apply_memory_limit(backend.module().total_memory())


def test_api_is_exported_at_top_level():
    for fn in ("get_active_memory", "get_peak_memory", "reset_peak_memory", "get_cache_memory", "set_memory_limit",
               "set_cache_limit", "clear_cache"):
        assert callable(getattr(anygpu, fn))


def _device():
    return backend.device()


def _return_freed_memory_to_the_os():
    """After big tests in this process (the engine's models), glibc keeps freed pages resident and a new
    allocation may reuse them without the RSS growing: trim them first so the allocation below is visible."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and _device().type == "cpu":
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def test_peak_tracks_a_large_allocation_and_resets():
    _return_freed_memory_to_the_os()
    backend.reset_peak_memory()
    before = anygpu.get_peak_memory()
    x = torch.ones(64 * 2**20 // 4, device=_device())  # 64 MiB, touched so the CPU really maps it
    assert anygpu.get_active_memory() >= 60 * 2**20
    peak = anygpu.get_peak_memory()
    assert peak >= before + 60 * 2**20
    del x
    anygpu.clear_cache()
    _return_freed_memory_to_the_os()
    anygpu.reset_peak_memory()
    assert anygpu.get_peak_memory() < peak


def test_setters_return_previous_value():
    total = anygpu.get_memory_limit()
    assert total > 0
    assert anygpu.set_memory_limit(total // 2) == total
    assert anygpu.set_memory_limit(total) == total // 2
    first = anygpu.get_cache_limit()
    assert anygpu.set_cache_limit(2**20) == first
    assert anygpu.set_cache_limit(0) == 2**20
    assert anygpu.get_cache_memory() == 0  # set_cache_limit trims at once


@pytest.mark.parametrize("bad", [-1, 1.5, "1GB", True, None])
def test_setters_reject_bad_values(bad):
    with pytest.raises(ValueError, match="limit: expected a non-negative int"):
        anygpu.set_memory_limit(bad)
    with pytest.raises(ValueError, match="limit: expected a non-negative int"):
        anygpu.set_cache_limit(bad)


def test_memory_limit_above_device_rejected():
    with pytest.raises(ValueError, match="limit: expected at most"):
        anygpu.set_memory_limit(anygpu.get_memory_limit() * 4 + 2**40)


@pytest.mark.gpu
def test_gpu_memory_limit_is_enforced_and_cache_trimmed():
    # Other tests in this process may leave small tensors alive (cached tables, fixtures): the free rest of the
    # allocator segments they sit in is cache that no trim can release.  Measure this test's blocks against that.
    gc.collect()
    anygpu.clear_cache()
    kept = anygpu.get_cache_memory()
    total = backend.module().total_memory()
    anygpu.set_memory_limit(4 * 2**30)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # torch.OutOfMemoryError is 2.5+
        torch.empty(8 * 2**30, dtype=torch.uint8, device="cuda")
    anygpu.set_memory_limit(total)
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del x
    assert anygpu.get_cache_memory() >= 256 * 2**20  # freed but cached by the allocator
    anygpu.set_cache_limit(2**20)
    assert anygpu.get_cache_memory() <= max(kept, 2**20)  # this test's 256 MiB released
