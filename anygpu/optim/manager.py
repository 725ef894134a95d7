"""``GlobalOptimManager``: bitsandbytes' per-parameter overrides of an optimizer's settings.

The same singleton API, so code written for bitsandbytes (transformers' Trainer keeps embeddings in 32-bit
this way) works unchanged:

    mng = GlobalOptimManager.get_instance()
    mng.register_parameters(model.parameters())          # optional: also match by position, as bitsandbytes
    opt = anygpu.optim.Adam(model.parameters(), optim_bits=8)
    mng.override_config(model.fc1.weight, "optim_bits", 32)
    mng.register_module_override(model.emb, "weight", {"optim_bits": 32})

Overridable keys: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``alpha``, ``t_alpha``, ``t_beta3``,
``optim_bits``, ``min_8bit_size``, ``max_unorm``; an override is read when a parameter's states are made
(``optim_bits``, ``min_8bit_size``) and on every step (the rest).
"""

from __future__ import annotations

import torch

OVERRIDABLE = frozenset({"lr", "betas", "eps", "weight_decay", "alpha", "t_alpha", "t_beta3", "optim_bits",
                         "min_8bit_size", "max_unorm"})


def check_optim_bits(optim_bits) -> int:
    if optim_bits not in (8, 32) or isinstance(optim_bits, bool):
        raise ValueError(f"optim_bits: expected 8 or 32, got {optim_bits!r}")
    return int(optim_bits)


class GlobalOptimManager:
    _instance = None

    def __init__(self):
        raise RuntimeError("GlobalOptimManager: call GlobalOptimManager.get_instance() instead")

    def initialize(self) -> None:
        self.pid2config: dict = {}
        self.index2config: dict = {}
        self.optimizer = None
        self.uses_config_override = False
        self.module_weight_config_triple: list = []

    @classmethod
    def get_instance(cls) -> GlobalOptimManager:
        if cls._instance is None:
            cls._instance = cls.__new__(cls)
            cls._instance.initialize()
        return cls._instance

    def register_parameters(self, params) -> None:
        """Remember the (group, index) positions of parameters already overridden, as bitsandbytes does, so an
        override also reaches an optimizer built over copies of them (``model.cuda()`` on older torch)."""
        groups = list(params)
        if not groups:
            return
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for gindex, group in enumerate(groups):
            for pindex, p in enumerate(group["params"]):
                if id(p) in self.pid2config:
                    self.index2config[(gindex, pindex)] = self.pid2config[id(p)]

    def override_config(self, parameters, key=None, value=None, key_value_dict=None) -> None:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        if key is not None and value is not None:
            if key_value_dict is not None:
                raise ValueError("key_value_dict: pass either key and value or key_value_dict, not both")
            key_value_dict = {key: value}
        if key_value_dict is None:
            raise ValueError("key_value_dict: expected key and value, or a dict of overrides")
        _check(key_value_dict)
        self.uses_config_override = True
        for p in parameters:
            self.pid2config.setdefault(id(p), {}).update(key_value_dict)

    def register_module_override(self, module, param_name: str, config: dict) -> None:
        if not isinstance(getattr(module, param_name, None), torch.Tensor):
            raise ValueError(f"param_name: {type(module).__name__} has no tensor attribute {param_name!r}")
        _check(config)
        self.module_weight_config_triple.append((module, param_name, config))

    def config_for(self, p: torch.Tensor, gindex: int, pindex: int) -> dict:
        """The overrides of one parameter: module overrides, then by position, then by identity (bitsandbytes'
        order, the later winning)."""
        config = {}
        for module, name, override in self.module_weight_config_triple:
            if getattr(module, name, None) is p:
                config.update(override)
        config.update(self.index2config.get((gindex, pindex), {}))
        config.update(self.pid2config.get(id(p), {}))
        return config


def _check(config) -> None:
    if not isinstance(config, dict):
        raise ValueError(f"config: expected a dict of overrides, got {type(config).__name__}")
    unknown = sorted(set(config) - OVERRIDABLE)
    if unknown:
        raise ValueError(f"config: unknown keys {unknown}; expected some of {sorted(OVERRIDABLE)}")
    if "optim_bits" in config:
        check_optim_bits(config["optim_bits"])
