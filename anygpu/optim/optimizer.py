"""The shared base of the 8-bit and 32-bit optimizers: torch.optim conventions, bitsandbytes' state layout.

Per parameter, ``self.state[p]`` holds bitsandbytes' keys: ``step`` (int), ``state1`` (and ``state2``
for two-state optimizers), and for 8-bit states ``qmap1`` / ``qmap2`` (the signed / unsigned dynamic
maps) and ``absmax1`` / ``absmax2`` (fp32, one per 256-element block).  Tensors with fewer than
``min_8bit_size`` elements, and every tensor of an ``optim_bits=32`` optimizer (the ``*32bit`` classes), keep
fp32 states.  ``GlobalOptimManager`` overrides (``optim/manager.py``) apply per parameter, as in bitsandbytes.
``state_dict()`` moves the quantization keys under
``"__bnb_optimizer_quant_state__"`` per parameter as bitsandbytes does (FSDP skips them), and
``load_state_dict`` reads ours and bitsandbytes' alike, keeping uint8 codes and fp32 absmax / maps as they
are (torch's loader would cast them to the parameter's dtype).

GPU parameters step through the fused Triton kernels (``kernels/optim_8bit.py``: one launch per parameter,
8-bit or fp32 states), CPU parameters (and GPUs under ``ANYGPU_KERNELS=reference``) through the PyTorch
reference (``optim/reference.py``).  ``step()`` never waits on the device (no ``.item()``, no host copy).

Paged optimizers (``is_paged=True``, the ``Paged*`` classes) keep the states of GPU parameters with at
least ``page_min_size`` elements in pinned host memory and stream them per step (``optim/paging.py``);
their ``state_dict`` is the unpaged one's, so checkpoints move between paged and unpaged optimizers.
"""

from __future__ import annotations

import os
from collections import defaultdict
from itertools import chain

import torch

from ..quant.maps import dynamic_map
from . import reference
from .manager import GlobalOptimManager, check_optim_bits
from .paging import PAGE_MIN_SIZE, PAGED_KEYS, StatePager, host_zeros, streams_states, to_host
from .reference import BLOCKSIZE, TWO_STATES, step_scalars

QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"
# bitsandbytes' set of keys moved under QUANT_STATE_KEY and never cast on load.
QUANT_KEYS = frozenset({"qmap1", "qmap2", "max1", "max2", "new_max1", "new_max2", "state1", "state2", "gnorm_vec",
                        "absmax1", "absmax2", "unorm_vec"})
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Update rules the 8-bit kernel runs under another name (bitsandbytes' name2optimizer_id does the same), and
# the ones it has no code for (those step through the PyTorch reference on every device).
KERNEL_RULES = {"lamb": "adam", "lars": "momentum"}
NO_KERNEL = frozenset({"adagrad"})


def check_hyperparameters(lr: float, betas: tuple, eps: float | None, weight_decay: float) -> None:
    """ValueError naming the argument: negative lr or weight_decay, a beta outside [0, 1), eps <= 0."""
    if not lr >= 0.0:
        raise ValueError(f"lr: expected >= 0, got {lr!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}]: expected a value in [0, 1), got {beta!r}")
    if eps is not None and not eps > 0.0:
        raise ValueError(f"eps: expected > 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay: expected >= 0, got {weight_decay!r}")


def _use_kernel(p: torch.Tensor) -> bool:
    if p.device.type != "cuda":
        return False
    return os.environ.get("ANYGPU_KERNELS", "triton").strip().lower() != "reference"


_DEVICE_TABLES: dict = {}


def search_tables(qmap1: torch.Tensor, qmap2: torch.Tensor | None) -> tuple:
    """The kernel's bucket tables for a parameter's maps (``kernels.optim_8bit.search_table``), or
    (None, None): then the kernel searches the generic tree.  A map on the device is never read (that would
    sync): the default maps (the shared ``dynamic_map`` tensors, which ``_init_state`` and
    ``load_state_dict`` use) get their table from the CPU copy, other device maps the tree."""
    from ..kernels.optim_8bit import search_table

    tables = []
    for qmap, signed in ((qmap1, True), (qmap2, False)):
        if qmap is None:
            tables.append(None)
        elif qmap.device.type == "cpu":
            tables.append(search_table(qmap, signed))
        elif qmap is dynamic_map(qmap.device, signed):
            key = (qmap.device, signed)
            if key not in _DEVICE_TABLES:
                host = search_table(dynamic_map(None, signed), signed)
                if host is not None:  # pinned, so the copy does not wait on the device
                    host = host.pin_memory()
                    _DEVICE_TABLES[key] = (host, host.to(qmap.device, non_blocking=True))
                else:
                    _DEVICE_TABLES[key] = (None, None)
            tables.append(_DEVICE_TABLES[key][1])
        else:
            tables.append(None)
    if tables[0] is None or (qmap2 is not None and tables[1] is None):
        return None, None
    return tables[0], tables[1]


def _canonical_map(value: torch.Tensor, device: torch.device, signed: bool) -> torch.Tensor:
    """The shared default map on ``device`` when ``value`` equals it (a loaded checkpoint's maps always do),
    else a copy of ``value`` there."""
    default = dynamic_map(None, signed)
    if value.dtype == torch.float32 and value.shape == default.shape and torch.equal(value.detach().cpu(), default):
        return dynamic_map(device, signed)
    return value.to(device, copy=True)


class Optimizer8bit(torch.optim.Optimizer):
    """Subclasses set ``update_name`` (one of ``reference.RULES``, or ``lamb`` / ``lars``) and build
    ``defaults`` with ``lr``, ``betas``, ``eps`` and ``weight_decay`` (AdEMAMix: also alpha, t_alpha, t_beta3).
    ``optim_bits`` (8 or 32) picks the states' precision; ``max_unorm`` > 0 clips fp32-state updates by the
    trust ratio (LAMB, LARS)."""

    update_name: str = ""
    # Paged optimizers page the states of GPU parameters with at least this many elements (bitsandbytes'
    # 1e5); set it on an instance before the first step to change that.
    page_min_size: int = PAGE_MIN_SIZE

    def __init__(self, params, defaults: dict, min_8bit_size: int = 4096, is_paged: bool = False,
                 optim_bits: int = 8, max_unorm: float = 0.0):
        if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
            raise ValueError(f"min_8bit_size: expected an int >= 0, got {min_8bit_size!r}")
        if not max_unorm >= 0.0:
            raise ValueError(f"max_unorm: expected >= 0, got {max_unorm!r}")
        self.min_8bit_size = min_8bit_size
        self.optim_bits = check_optim_bits(optim_bits)
        self.max_unorm = float(max_unorm)
        self.mng = GlobalOptimManager.get_instance()
        self.is_paged = bool(is_paged)
        self._pagers: dict = {}
        self._simulate_paging = False  # tests: page CPU parameters too (through CPU slots)
        super().__init__(params, defaults)

    def _pages(self, p: torch.Tensor) -> bool:
        """Whether p's states live on the host and stream (decided when they are made or loaded)."""
        if self._simulate_paging and p.device.type == "cpu":
            return self.is_paged and p.numel() >= self.page_min_size
        return streams_states(self.is_paged, p.device, p.numel(), self.page_min_size)

    def _zeros(self, shape: tuple, dtype: torch.dtype, p: torch.Tensor, paged: bool) -> torch.Tensor:
        if paged:
            return host_zeros(shape, dtype, pin=p.device.type == "cuda")
        return torch.zeros(shape, dtype=dtype, device=p.device)

    def _config(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> dict:
        """The group's settings with this optimizer's and the manager's overrides for p (bitsandbytes' get_config)."""
        config = dict(group, optim_bits=self.optim_bits, min_8bit_size=self.min_8bit_size, max_unorm=self.max_unorm)
        config.update(self.mng.config_for(p, gindex, pindex))
        return config

    def _init_state(self, p: torch.Tensor, state: dict, config: dict) -> None:
        if p.dtype not in PARAM_DTYPES:
            raise ValueError(f"params: expected fp32, fp16 or bf16 parameters, got {p.dtype}")
        two = KERNEL_RULES.get(self.update_name, self.update_name) in TWO_STATES
        lead = (2,) if self.update_name == "ademamix" else ()  # AdEMAMix's state1: the fast and slow EMAs
        paged = self._pages(p)
        state["step"] = 0
        if config["optim_bits"] == 32 or p.numel() < config["min_8bit_size"]:
            state["state1"] = self._zeros(lead + p.shape, torch.float32, p, paged)
            if two:
                state["state2"] = self._zeros(p.shape, torch.float32, p, paged)
            return
        blocks = -(-p.numel() // BLOCKSIZE)
        state["state1"] = self._zeros(lead + p.shape, torch.uint8, p, paged)
        state["qmap1"] = dynamic_map(p.device, signed=True)
        state["absmax1"] = self._zeros(lead + (blocks,), torch.float32, p, paged)
        if two:
            state["state2"] = self._zeros(p.shape, torch.uint8, p, paged)
            state["qmap2"] = dynamic_map(p.device, signed=False)
            state["absmax2"] = self._zeros((blocks,), torch.float32, p, paged)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        streamed = defaultdict(list)  # device -> [(p, state, group)] whose states are on the host
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("params: sparse gradients are not supported")
                state = self.state[p]
                config = self._config(group, p, gindex, pindex)
                if not state:
                    self._init_state(p, state, config)
                if self._is_streamed(p, state):
                    streamed[p.device].append((p, state, config))
                else:
                    self._update(p, state, config)
        for device, items in streamed.items():
            pager = self._pagers.get(device)
            if pager is None:
                pager = self._pagers[device] = StatePager(device)
            pager.run(items, self._update)
        return loss

    def _is_streamed(self, p: torch.Tensor, state: dict) -> bool:
        """Where the states are decides: on the host for a GPU parameter (or in CPU simulation)."""
        if not self.is_paged or state["state1"].device.type != "cpu":
            return False
        return p.device.type == "cuda" or (self._simulate_paging and self._pages(p))

    def _update(self, p: torch.Tensor, state: dict, group: dict, tensors: dict | None = None) -> None:
        """One step of p; ``tensors``: the device copies of the paged states (default: ``state``'s own)."""
        t = state if tensors is None else tensors
        state["step"] += 1
        beta1, beta2 = group["betas"][0], group["betas"][1]
        name = KERNEL_RULES.get(self.update_name, self.update_name)
        k = step_scalars(name, group["lr"], beta1, beta2, group.get("eps", 0.0),
                         group["weight_decay"], state["step"], *self._beta3_alpha(group, state["step"]))
        max_unorm = group.get("max_unorm", 0.0)
        kernel = _use_kernel(p) and name not in NO_KERNEL
        if t["state1"].dtype == torch.uint8:
            if not p.is_contiguous():  # the kernel and the reference read row-major order
                raise ValueError("params: 8-bit states need contiguous parameters")
            args = (name, p, p.grad, t["state1"], t.get("state2"), t["absmax1"], t.get("absmax2"),
                    state["qmap1"], state.get("qmap2"), k)
            if kernel:
                from ..kernels.optim_8bit import update_8bit  # lazily: anygpu does not need triton on the CPU

                update_8bit(*args, *search_tables(state["qmap1"], state.get("qmap2")))
            else:
                reference.update_8bit(*args)
        elif kernel and not max_unorm > 0:  # the kernel has no trust ratio: clipped updates take the reference
            from ..kernels.optim_8bit import update_32bit

            update_32bit(name, p, p.grad, t["state1"], t.get("state2"), k)
        else:
            reference.update_32bit(name, p, p.grad, t["state1"], t.get("state2"), k, max_unorm)

    def synchronize(self) -> None:
        """Wait until the states a paged optimizer streamed back are in host memory: call it before reading
        ``self.state`` on the host (``state_dict`` and ``load_state_dict`` do).  A no-op when unpaged."""
        for pager in self._pagers.values():
            pager.synchronize()

    def wait_for_copies(self) -> None:
        """Make each device's current stream wait for the states a paged optimizer is still copying back,
        without blocking the host (timing a step with CUDA events needs it).  A no-op when unpaged."""
        for pager in self._pagers.values():
            if pager.cuda:
                torch.cuda.current_stream(pager.device).wait_stream(pager.copy_out)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(min_8bit_size=self.min_8bit_size, is_paged=self.is_paged, optim_bits=self.optim_bits,
                     max_unorm=self.max_unorm)
        state.pop("mng", None)  # the process's singleton: never pickled, re-attached on load
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("min_8bit_size", 4096)
        self.__dict__.setdefault("is_paged", False)
        self.__dict__.setdefault("optim_bits", 8)
        self.__dict__.setdefault("max_unorm", 0.0)
        self.__dict__["mng"] = GlobalOptimManager.get_instance()
        self.__dict__.setdefault("_pagers", {})
        self.__dict__.setdefault("_simulate_paging", False)
        for param_state in self.state.values():  # a deepcopy or unpickle copies the shared default maps
            for key, signed in (("qmap1", True), ("qmap2", False)):
                qmap = param_state.get(key) if isinstance(param_state, dict) else None
                if isinstance(qmap, torch.Tensor) and qmap is not dynamic_map(qmap.device, signed):
                    param_state[key] = _canonical_map(qmap, qmap.device, signed)

    def _beta3_alpha(self, group: dict, step: int) -> tuple[float, float]:
        """AdEMAMix's scheduled (beta3, alpha); (0, 0) for the others."""
        return 0.0, 0.0

    def state_dict(self) -> dict:
        """bitsandbytes' layout (quantization keys under ``"__bnb_optimizer_quant_state__"``); a paged
        optimizer's paged states are its pinned CPU tensors, the rest on the parameters' devices."""
        self.synchronize()
        sd = super().state_dict()
        wrapped = {}
        for index, param_state in sd["state"].items():
            param_state = dict(param_state)  # torch's state_dict copies shallowly: never mutate ours
            quant = {key: param_state.pop(key) for key in list(param_state) if key in QUANT_KEYS}
            if quant:
                param_state[QUANT_STATE_KEY] = quant
            wrapped[index] = param_state
        sd["state"] = wrapped
        return sd

    def load_state_dict(self, state_dict: dict, move_to_device: bool = True) -> None:
        """Load ours or bitsandbytes' (wrapped under ``"__bnb_optimizer_quant_state__"`` or not), paged or not:
        the states go where this optimizer keeps them (pinned host memory for the paged parameters of a
        paged optimizer, else the parameter's device); maps equal to the default dynamic maps become the
        shared ones (the kernel has a fast search for those)."""
        self.synchronize()  # copies still streaming back must not land after the new states
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict: expected a dict with 'state' and 'param_groups'")
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("state_dict: a different number of parameter groups than this optimizer has")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("state_dict: a parameter group whose size differs from this optimizer's")
        id_map = dict(zip(chain.from_iterable(s["params"] for s in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        state = defaultdict(dict)
        for index, saved in state_dict["state"].items():
            saved = dict(saved)
            saved.update(saved.pop(QUANT_STATE_KEY, {}))
            p = id_map.get(index)
            if p is None:
                state[index] = saved
                continue
            loaded = {}
            paged = self._pages(p)
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    # Codes, maps, absmax and fp32 states keep their dtype (never the parameter's).
                    if key == "step":
                        value = int(value.item())
                    elif not move_to_device:
                        value = value.clone()
                    elif key in ("qmap1", "qmap2"):
                        value = _canonical_map(value, p.device, signed=key == "qmap1")
                    elif paged and key in PAGED_KEYS:
                        value = to_host(value, pin=p.device.type == "cuda")
                    else:
                        value = value.to(p.device, copy=True)
                loaded[key] = value
            state[p] = loaded
        new_groups = []
        for group, saved in zip(groups, saved_groups):
            merged = dict(saved)
            merged["params"] = group["params"]
            new_groups.append(merged)
        self.__setstate__({"state": state, "param_groups": new_groups})
