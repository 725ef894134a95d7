"""Paged 8-bit optimizers (anygpu.optim.Paged*, ``is_paged=True``): paged == unpaged bit for bit, the
state_dict shared with the unpaged optimizers (and bitsandbytes), and the streaming path: through CPU
slots here (``_simulate_paging``), through pinned host memory and CUDA streams on a GPU (tests marked gpu)."""

import io

import pytest
import torch

import anygpu.optim as ao
from anygpu.optim import QUANT_STATE_KEY, streams_states
from anygpu.optim.paging import PAGED_KEYS, StatePager, slot_bytes

PAIRS = [  # (paged class, unpaged class, kwargs)
    ("PagedAdam8bit", "Adam8bit", dict(lr=1e-3, weight_decay=0.01)),
    ("PagedAdamW8bit", "AdamW8bit", dict(lr=1e-3)),
    ("PagedLion8bit", "Lion8bit", dict(lr=1e-4, weight_decay=0.1)),
    ("PagedAdEMAMix8bit", "AdEMAMix8bit", dict(lr=1e-3, t_alpha=5, t_beta3=5)),
]
IDS = [p[0] for p in PAIRS]


def _params(device="cpu", shapes=((64, 256), (3000,), (1500,), (10,))):
    """With min_8bit_size 2000 and page_min_size 1000: two paged 8-bit parameters (one with a partial last
    block), a paged one with fp32 states, and a small one whose states are never paged."""
    gen = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(device)) for s in shapes]


def _run(opt, params, steps, seed=5):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 0.01
            g.view(-1)[0] = float("nan")  # the non-finite path streams too
            p.grad = g.to(p.device)
        opt.step()


def _paged(name, params, kwargs, simulate=True, page_min_size=1000):
    opt = getattr(ao, name)(params, min_8bit_size=2000, **kwargs)
    opt.page_min_size = page_min_size
    opt._simulate_paging = simulate
    return opt


def _assert_same(params_a, opt_a, params_b, opt_b):
    opt_a.synchronize()
    opt_b.synchronize()
    for a, b in zip(params_a, params_b):
        assert torch.equal(a.detach().cpu(), b.detach().cpu())
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert sorted(sa) == sorted(sb)
        for key, value in sb.items():
            if isinstance(value, torch.Tensor):
                assert sa[key].dtype == value.dtype and torch.equal(sa[key].cpu(), value.cpu()), key
            else:
                assert sa[key] == value, key


def test_streaming_decision():
    """Paged, a GPU parameter and at least page_min_size (bitsandbytes' 1e5) elements: the states stream."""
    cuda = torch.device("cuda")
    assert streams_states(True, cuda, 100_000)
    assert not streams_states(True, cuda, 99_999)
    assert not streams_states(False, cuda, 10**9)
    assert not streams_states(True, torch.device("cpu"), 10**9)  # CPU parameters: never paged
    assert streams_states(True, "cuda:1", 10, page_min_size=10) and not streams_states(True, "cuda:1", 9, 10)
    assert ao.PAGE_MIN_SIZE == 100_000


def test_paged_classes_and_flags():
    p = [torch.nn.Parameter(torch.zeros(4))]
    for name, unpaged, _ in PAIRS:
        assert getattr(ao, name)(p).is_paged and not getattr(ao, unpaged)(p).is_paged
        assert isinstance(getattr(ao, name)(p), getattr(ao, unpaged))
    for name in ("Adam8bit", "AdamW8bit", "Lion8bit", "AdEMAMix8bit"):  # bitsandbytes' is_paged flag
        assert getattr(ao, name)(p, is_paged=True).is_paged
    assert ao.PagedAdam8bit(p, is_paged=False).is_paged  # accepted and ignored, as bitsandbytes does
    with pytest.raises(ValueError, match="lr"):
        ao.PagedAdamW8bit(p, lr=-1.0)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        ao.PagedLion8bit(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        ao.PagedAdEMAMix8bit(p, eps=0.0)


@pytest.mark.parametrize("simulate", [False, True], ids=["cpu-unpaged", "cpu-slots"])
@pytest.mark.parametrize("paged,unpaged,kwargs", PAIRS, ids=IDS)
def test_paged_equals_unpaged_bit_for_bit(paged, unpaged, kwargs, simulate):
    """On CPU parameters a paged optimizer is its unpaged self; through the CPU slots (the streaming path:
    copy in, update the copies, copy back) it must give the same bits."""
    pa, pb = _params(), _params()
    opt_a = _paged(paged, pa, kwargs, simulate)
    opt_b = getattr(ao, unpaged)(pb, min_8bit_size=2000, **kwargs)
    _run(opt_a, pa, 4)
    _run(opt_b, pb, 4)
    _assert_same(pa, opt_a, pb, opt_b)
    assert bool(opt_a._pagers) == simulate
    for p in pa:
        assert all(v.device.type == "cpu" for v in opt_a.state[p].values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("paged,unpaged,kwargs", PAIRS, ids=IDS)
def test_state_dict_round_trips_between_paged_and_unpaged(paged, unpaged, kwargs):
    """The same state_dict format: paged -> unpaged and unpaged -> paged (through torch.save), then both
    continue bit for bit."""
    pa, pb = _params(), _params()
    opt_a = _paged(paged, pa, kwargs)
    _run(opt_a, pa, 3)
    sd = opt_a.state_dict()
    assert set(sd["state"][0][QUANT_STATE_KEY]) >= {"state1", "qmap1", "absmax1"}
    fp32 = sd["state"][2][QUANT_STATE_KEY]  # bitsandbytes moves fp32 states there too
    assert fp32["state1"].dtype == torch.float32 and "qmap1" not in fp32
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    with torch.no_grad():
        for a, b in zip(pa, pb):
            b.copy_(a)
    opt_b = getattr(ao, unpaged)(pb, min_8bit_size=2000, **kwargs)
    opt_b.load_state_dict(torch.load(buffer, weights_only=True))
    _assert_same(pa, opt_a, pb, opt_b)
    # ... and back into a fresh paged optimizer
    pc = _params()
    with torch.no_grad():
        for a, c in zip(pa, pc):
            c.copy_(a)
    opt_c = _paged(paged, pc, kwargs)
    opt_c.load_state_dict(opt_b.state_dict())
    for opt, params in ((opt_a, pa), (opt_b, pb), (opt_c, pc)):
        _run(opt, params, 2, seed=9)
    _assert_same(pa, opt_a, pb, opt_b)
    _assert_same(pc, opt_c, pb, opt_b)


def test_loaded_default_maps_are_the_shared_ones():
    """A checkpoint's maps equal to the default dynamic maps load as the shared tensors (the kernel has a
    fast search for exactly those); other maps load as copies."""
    from anygpu.quant.maps import dynamic_map

    pa, pb = _params(), _params()
    opt_a = ao.AdamW8bit(pa, min_8bit_size=2000)
    _run(opt_a, pa, 1)
    sd = opt_a.state_dict()
    sd["state"][1][QUANT_STATE_KEY]["qmap2"] = sd["state"][1][QUANT_STATE_KEY]["qmap2"] * 1.0  # a copy, same values
    opt_b = ao.PagedAdamW8bit(pb, min_8bit_size=2000)
    opt_b.load_state_dict(sd)
    assert opt_b.state[pb[0]]["qmap1"] is dynamic_map(signed=True)
    assert opt_b.state[pb[1]]["qmap2"] is dynamic_map(signed=False)


def test_pager_slots_hold_aligned_views_and_grow():
    pager = StatePager(torch.device("cpu"))
    small = {"state1": torch.zeros(300, dtype=torch.uint8), "absmax1": torch.zeros(2)}
    big = {"state1": torch.zeros(2, 5000, dtype=torch.uint8), "state2": torch.zeros(5000, dtype=torch.uint8),
           "absmax1": torch.zeros(2, 20), "absmax2": torch.zeros(20)}
    assert slot_bytes(small) == 512 + 256 and slot_bytes(big) == 10240 + 5120 + 256 + 256
    seen = []

    def update(p, state, group, tensors):
        assert set(tensors) == {k for k in PAGED_KEYS if k in state}
        for key, view in tensors.items():
            assert view.shape == state[key].shape and view.dtype == state[key].dtype
            assert any((view.data_ptr() - slot.data_ptr()) % 256 == 0 for slot in pager.slots)  # aligned in its slot
            assert view.data_ptr() != state[key].data_ptr()
            view.add_(1)  # the copy back must carry this home
        seen.append(tensors["state1"].data_ptr())

    pager.run([(None, small, None)], update)
    first = pager.slots[0]
    pager.run([(None, big, None), (None, small, None), (None, big, None)], update)
    assert pager.slots[0].numel() >= slot_bytes(big) and pager.slots[0] is not first  # grown
    assert seen[1] == seen[3] != seen[2]  # parameters alternate between the two slots
    assert int(small["state1"][0]) == 2 and int(big["state1"][0, 0]) == 2 and float(big["absmax2"][0]) == 2.0


# ---- on a GPU: pinned host memory, side streams and events ------------------------------------------------

def _gpu_params(shapes=((1024, 1024), (300_001,), (150_000,), (2048,), (99_999,))):
    """With min_8bit_size 200_000: paged 8-bit parameters (one with a partial last block), a paged one with
    fp32 states, and two whose fp32 states stay on the device (one just under page_min_size)."""
    return _params("cuda", shapes)


@pytest.mark.gpu
@pytest.mark.parametrize("paged,unpaged,kwargs", PAIRS, ids=IDS)
def test_gpu_paged_equals_unpaged_bit_for_bit(paged, unpaged, kwargs):
    """The same kernel on the same data: the streamed states must give the unpaged optimizer's bits, step
    after step (any ordering bug, a copy back landing late or a slot refilled early, shows up here)."""
    pa, pb = _gpu_params(), _gpu_params()
    opt_a = getattr(ao, paged)(pa, min_8bit_size=200_000, **kwargs)
    opt_b = getattr(ao, unpaged)(pb, min_8bit_size=200_000, **kwargs)
    for step in range(6):
        _run(opt_a, pa, 1, seed=step)
        _run(opt_b, pb, 1, seed=step)
        if step % 2:  # reading the states on the host between steps
            _assert_same(pa, opt_a, pb, opt_b)
    _assert_same(pa, opt_a, pb, opt_b)
    for p in pa:
        state = opt_a.state[p]
        on_host = p.numel() >= ao.PAGE_MIN_SIZE
        for key in PAGED_KEYS:
            if key in state:
                assert (state[key].device.type == "cpu") == on_host, (p.shape, key)
                assert not on_host or state[key].is_pinned()
        if "qmap1" in state:
            assert state["qmap1"].device.type == "cuda"


@pytest.mark.gpu
def test_gpu_paged_step_never_syncs_and_saves_device_memory():
    """After the first step (allocations), step() of a paged and an unpaged optimizer queues work without
    waiting on the device (CUDA's sync debug mode raises on any synchronizing call), and the paged one
    holds two slots of states on the device, not every parameter's."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    params = _params("cuda", shapes=((4096, 4096),) * 6)  # 6 x 16.8M elements
    opt = ao.PagedAdamW8bit(params)
    _run(opt, params, 1)
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated() - base - sum(p.nbytes * 2 for p in params)  # params and grads
    state_bytes = sum(opt.state[p][k].nbytes for p in params for k in PAGED_KEYS)
    assert used < 0.5 * state_bytes, (used, state_bytes)  # two of six parameters' states
    unpaged = ao.AdamW8bit(_params("cuda", shapes=((4096, 4096),) * 2))
    _run(unpaged, unpaged.param_groups[0]["params"], 1)
    torch.cuda.synchronize()
    for o in (opt, unpaged):
        grads = [p.grad for p in o.param_groups[0]["params"]]
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                o.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(p.grad is g for p, g in zip(o.param_groups[0]["params"], grads))
    opt.synchronize()


@pytest.mark.gpu
def test_gpu_paged_on_a_side_stream_and_state_dict():
    """step() on a non-default current stream (the copies follow it), then a state_dict taken right away
    (it waits for the copies back) loads into an unpaged optimizer that continues bit for bit."""
    pa, pb = _gpu_params(), _gpu_params()
    opt_a = ao.PagedAdamW8bit(pa, min_8bit_size=200_000)
    opt_b = ao.AdamW8bit(pb, min_8bit_size=200_000)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run(opt_a, pa, 3)
        sd = opt_a.state_dict()
        snapshot = {i: {k: v.clone() for k, v in s.get(QUANT_STATE_KEY, s).items() if isinstance(v, torch.Tensor)}
                    for i, s in sd["state"].items()}
    torch.cuda.current_stream().wait_stream(side)
    _run(opt_b, pb, 3)
    _assert_same(pa, opt_a, pb, opt_b)
    for i, p in enumerate(pb):
        for key, value in snapshot[i].items():
            assert torch.equal(value.cpu(), opt_b.state[p][key].cpu()), (i, key)
    pc = _gpu_params()
    with torch.no_grad():
        for a, c in zip(pa, pc):
            c.copy_(a)
    opt_c = ao.AdamW8bit(pc, min_8bit_size=200_000)
    opt_c.load_state_dict(sd)
    _run(opt_a, pa, 2, seed=11)
    _run(opt_c, pc, 2, seed=11)
    _assert_same(pa, opt_a, pc, opt_c)


def test_bench_suite_builds_and_runs_on_the_cpu():
    """``anygpu bench optim --quick`` on the CPU: each case and baseline runs (times are not checked), the
    state ratio is in the shape, and the bytes are those of an 8-bit Adam step."""
    from anygpu.bench import load_suites

    cases = load_suites()["optim"](torch.device("cpu"), quick=True)
    assert [c.op for c in cases] == ["adamw8bit_step", "paged_adamw8bit_step"]
    adamw, paged = cases
    assert "state 25.6% of torch" in adamw.shape  # 2 x 128 x 512: (2 + 8/256) / 8 of fp32 Adam, plus two maps
    n = 2 * 128 * 512
    assert adamw.bytes == n * 16 + (n // 256) * 16 and paged.bytes is None
    assert set(adamw.baselines) == {"torch AdamW fused", "bitsandbytes"}
    for case in cases:
        case.ours()
        for fn in case.baselines.values():
            try:
                fn()
            except ImportError:  # bitsandbytes missing: reported by the harness, not raised
                pass
