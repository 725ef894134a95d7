"""Paged optimizer states: pinned host memory, streamed through two device slots each step.

bitsandbytes' paged optimizers put large states in CUDA managed memory and let the driver page them.
Here the states of a paged parameter (``state1``, ``state2``, ``absmax1``, ``absmax2``; the code maps
stay on the device) are ordinary pinned CPU tensors, and ``step()`` streams them:

    copy stream in   H2D(0)  H2D(1)        H2D(2)        H2D(3) ...
    compute stream           update(0)     update(1)     update(2) ...
    copy stream out                 D2H(0)        D2H(1)        D2H(2) ...

Parameter i's states go to device slot i % 2 on one side stream while the parameter before it updates on
the current stream, and come back on another side stream (PCIe moves both ways at once).  Events order
each step: the update waits for its states to arrive (``loaded``); the copy back waits for the update
(``updated``); a slot is refilled only once its previous states are back on the host (``stored``); and a
step's first copies in wait for every copy back of the step before, so the host copy of a state is
always complete before the next read of it on the device.  Nothing waits on the host: reading the
states on the host (``state_dict``, or ``opt.state`` directly) needs ``Optimizer8bit.synchronize()``
first, which ``state_dict`` and ``load_state_dict`` call.

The device holds two slots of the largest paged parameter's states (``2 * 2.03`` bytes per element for
Adam), instead of every parameter's.  On a CPU parameter paging is off: the states are ordinary CPU
tensors and a paged optimizer is its unpaged self.  ``StatePager`` also runs on the CPU (slots in host
memory, copies synchronous), which the tests use to check the streaming path bit for bit without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PAGED_KEYS = ("state1", "state2", "absmax1", "absmax2")
# bitsandbytes pages the states of parameters with at least 1e5 elements; smaller ones stay on the device.
PAGE_MIN_SIZE = 100_000
_ALIGN = 256  # bytes: every view in a slot starts 256-byte aligned (wide loads in the kernel)


def streams_states(is_paged: bool, device: torch.device, numel: int, page_min_size: int = PAGE_MIN_SIZE) -> bool:
    """Whether a parameter's states live in pinned host memory and stream to the GPU each step: a paged
    optimizer, a GPU parameter, and at least ``page_min_size`` elements."""
    return bool(is_paged) and torch.device(device).type == "cuda" and numel >= page_min_size


def host_zeros(shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed CPU tensor, pinned when ``pin`` (for asynchronous copies to and from a GPU)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


def to_host(value: torch.Tensor, pin: bool) -> torch.Tensor:
    """A CPU copy of ``value`` (pinned when ``pin``), never sharing memory with it."""
    out = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
    out.copy_(value)
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def slot_bytes(state: dict) -> int:
    """Bytes one slot needs for a parameter's paged states."""
    return sum(_aligned(state[k].nbytes) for k in PAGED_KEYS if k in state)


class StatePager:
    """Streams paged states through two slots on ``device``; one per device per optimizer."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots: list[torch.Tensor | None] = [None, None]
        self.done = None  # the event of the last copy back (CUDA)
        if self.cuda:
            self.copy_in = torch.cuda.Stream(self.device)
            self.copy_out = torch.cuda.Stream(self.device)
            self.loaded = [torch.cuda.Event(), torch.cuda.Event()]
            self.updated = [torch.cuda.Event(), torch.cuda.Event()]
            self.stored = [torch.cuda.Event(), torch.cuda.Event()]

    def _ensure_slots(self, nbytes: int, compute) -> bool:
        """Grow both slots to ``nbytes``; True when they are new."""
        if self.slots[0] is not None and self.slots[0].numel() >= nbytes:
            return False
        if self.cuda and self.slots[0] is not None:
            # The old slots were allocated on the compute stream; once it has waited for the side streams'
            # last copies, the caching allocator may hand their memory to the compute stream's next use.
            compute.wait_stream(self.copy_in)
            compute.wait_stream(self.copy_out)
        self.slots = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return True

    def _views(self, slot: torch.Tensor, state: dict) -> dict:
        views, offset = {}, 0
        for key in PAGED_KEYS:
            if key in state:
                host = state[key]
                views[key] = slot[offset:offset + host.nbytes].view(host.dtype).view(host.shape)
                offset += _aligned(host.nbytes)
        return views

    def run(self, items: list, update: Callable[[torch.Tensor, dict, dict, dict], None]) -> None:
        """Step every ``(p, state, group)`` of ``items`` (states on the host): ``update(p, state, group,
        tensors)`` runs on the current stream with ``tensors`` the states' device copies."""
        if not items:
            return
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        new = self._ensure_slots(max(slot_bytes(state) for _, state, _ in items), compute)
        views = [self._views(self.slots[i % 2], state) for i, (_, state, _) in enumerate(items)]
        if not self.cuda:  # the same path, synchronously: what the CPU tests check
            for (p, state, group), tensors in zip(items, views):
                for key, view in tensors.items():
                    view.copy_(state[key])
                update(p, state, group, tensors)
                for key, view in tensors.items():
                    state[key].copy_(view)
            return
        # The host states of the last step are back and both slots free before the first copy in; new
        # slots may be memory the compute stream used a moment ago.
        self.copy_in.wait_stream(self.copy_out)
        if new:
            self.copy_in.wait_stream(compute)

        def load(i: int) -> None:
            slot = i % 2
            with torch.cuda.stream(self.copy_in):
                if i >= 2:
                    self.copy_in.wait_event(self.stored[slot])  # parameter i-2's states are back on the host
                for key, view in views[i].items():
                    view.copy_(items[i][1][key], non_blocking=True)
                self.loaded[slot].record(self.copy_in)

        load(0)
        for i, (p, state, group) in enumerate(items):
            if i + 1 < len(items):
                load(i + 1)  # prefetch the next parameter's states while this one updates
            slot = i % 2
            compute.wait_event(self.loaded[slot])
            update(p, state, group, views[i])
            self.updated[slot].record(compute)
            with torch.cuda.stream(self.copy_out):
                self.copy_out.wait_event(self.updated[slot])
                for key, view in views[i].items():
                    state[key].copy_(view, non_blocking=True)
                self.stored[slot].record(self.copy_out)
        self.done = torch.cuda.Event()
        self.done.record(self.copy_out)

    def synchronize(self) -> None:
        """Wait (on the host) until every state copied back by ``run`` is in host memory."""
        if self.done is not None:
            self.done.synchronize()
