"""``PytorchLARS``: bitsandbytes' plain-PyTorch LARS (fp32 ``momentum_buffer`` per parameter, torch.optim
style), with the same rule: coupled weight decay, momentum with dampening, optional Nesterov, and the update
scaled by ``min(1, max_unorm * |p| / |update|)``.  Without momentum the update is the decayed gradient
(bitsandbytes fails there with a NameError)."""

from __future__ import annotations

import torch

from .reference import trust_ratio


class PytorchLARS(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01, momentum=0, dampening=0, weight_decay=0, nesterov=False, max_unorm=0.02):
        if not lr >= 0.0:
            raise ValueError(f"lr: expected >= 0, got {lr!r}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum: expected >= 0, got {momentum!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay: expected >= 0, got {weight_decay!r}")
        if not max_unorm >= 0.0:
            raise ValueError(f"max_unorm: expected >= 0, got {max_unorm!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: needs a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, max_unorm=max_unorm))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum, max_unorm = group["momentum"], group["max_unorm"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad
                if group["weight_decay"]:
                    d_p = d_p.add(p, alpha=group["weight_decay"])
                update = d_p
                if momentum:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = d_p.detach().clone()
                    else:
                        buf.mul_(momentum).add_(d_p, alpha=1 - group["dampening"])
                    update = d_p + buf * momentum if group["nesterov"] else buf
                if max_unorm > 0.0:
                    if p.dtype != torch.float32:
                        raise ValueError(f"params: PytorchLARS' trust ratio needs fp32 parameters, got {p.dtype}")
                    update = update * trust_ratio(update, torch.linalg.vector_norm(p), max_unorm)
                p.add_(update, alpha=-group["lr"])
        return loss
