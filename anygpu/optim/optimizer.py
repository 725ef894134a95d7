"""The shared base of the 8-bit optimizers: torch.optim conventions, bitsandbytes' state layout.

Per parameter, ``self.state[p]`` holds bitsandbytes' keys: ``step`` (int), ``state1`` (and ``state2``
for two-state optimizers), and for 8-bit states ``qmap1`` / ``qmap2`` (the signed / unsigned dynamic
maps) and ``absmax1`` / ``absmax2`` (fp32, one per 256-element block).  Tensors with fewer than
``min_8bit_size`` elements keep fp32 states.  ``state_dict()`` moves the quantization keys under
``"__bnb_optimizer_quant_state__"`` per parameter as bitsandbytes does (FSDP skips them), and
``load_state_dict`` reads ours and bitsandbytes' alike, keeping uint8 codes and fp32 absmax / maps as they
are (torch's loader would cast them to the parameter's dtype).

GPU parameters step through the fused Triton kernel (``kernels/optim_8bit.py``), CPU parameters (and GPUs
under ``ANYGPU_KERNELS=reference``) through the PyTorch reference (``optim/reference.py``).
Paged variants are not implemented.
"""

from __future__ import annotations

import os
from collections import defaultdict
from itertools import chain

import torch

from ..quant.maps import dynamic_map
from . import reference
from .reference import BLOCKSIZE, TWO_STATES, step_scalars

QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"
# bitsandbytes' set of keys moved under QUANT_STATE_KEY and never cast on load.
QUANT_KEYS = frozenset({"qmap1", "qmap2", "max1", "max2", "new_max1", "new_max2", "state1", "state2", "gnorm_vec",
                        "absmax1", "absmax2", "unorm_vec"})
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


class Optimizer8bit(torch.optim.Optimizer):
    """Subclasses set ``update_name`` (one of ``reference.OPTIMIZERS``) and build ``defaults``
    with ``lr``, ``betas``, ``eps`` and ``weight_decay`` (AdEMAMix: also alpha, t_alpha, t_beta3)."""

    update_name: str = ""

    def __init__(self, params, defaults: dict, min_8bit_size: int = 4096):
        if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
            raise ValueError(f"min_8bit_size: expected an int >= 0, got {min_8bit_size!r}")
        self.min_8bit_size = min_8bit_size
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        if p.dtype not in PARAM_DTYPES:
            raise ValueError(f"params: expected fp32, fp16 or bf16 parameters, got {p.dtype}")
        two = self.update_name in TWO_STATES
        lead = (2,) if self.update_name == "ademamix" else ()  # AdEMAMix's state1: the fast and slow EMAs
        state["step"] = 0
        if p.numel() < self.min_8bit_size:
            state["state1"] = torch.zeros(lead + p.shape, dtype=torch.float32, device=p.device)
            if two:
                state["state2"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return
        blocks = -(-p.numel() // BLOCKSIZE)
        state["state1"] = torch.zeros(lead + p.shape, dtype=torch.uint8, device=p.device)
        state["qmap1"] = dynamic_map(p.device, signed=True)
        state["absmax1"] = torch.zeros(lead + (blocks,), dtype=torch.float32, device=p.device)
        if two:
            state["state2"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
            state["qmap2"] = dynamic_map(p.device, signed=False)
            state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("params: sparse gradients are not supported")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                self._update(p, state, group)
        return loss

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        state["step"] += 1
        beta1, beta2 = group["betas"][0], group["betas"][1]
        k = step_scalars(self.update_name, group["lr"], beta1, beta2, group.get("eps", 0.0),
                         group["weight_decay"], state["step"], *self._beta3_alpha(group, state["step"]))
        name = self.update_name
        if state["state1"].dtype == torch.uint8:
            if not p.is_contiguous():  # the kernel and the reference read row-major order
                raise ValueError("params: 8-bit states need contiguous parameters")
            args = (name, p, p.grad, state["state1"], state.get("state2"), state["absmax1"], state.get("absmax2"),
                    state["qmap1"], state.get("qmap2"), k)
            if _use_kernel(p):
                from ..kernels.optim_8bit import update_8bit  # lazily: anygpu does not need triton on the CPU

                update_8bit(*args)
            else:
                reference.update_8bit(*args)
        else:
            reference.update_32bit(name, p, p.grad, state["state1"], state.get("state2"), k)

    def _beta3_alpha(self, group: dict, step: int) -> tuple[float, float]:
        """AdEMAMix's scheduled (beta3, alpha); (0, 0) for the others."""
        return 0.0, 0.0

    def state_dict(self) -> dict:
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
        """Load ours or bitsandbytes' (wrapped under ``"__bnb_optimizer_quant_state__"`` or not)."""
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
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    # Codes, maps, absmax and fp32 states keep their dtype (never the parameter's).
                    value = value.to(p.device, copy=True) if move_to_device else value.clone()
                    if key == "step":
                        value = int(value.item())
                loaded[key] = value
            state[p] = loaded
        new_groups = []
        for group, saved in zip(groups, saved_groups):
            merged = dict(saved)
            merged["params"] = group["params"]
            new_groups.append(merged)
        self.__setstate__({"state": state, "param_groups": new_groups})
