"""LoRA on anygpu's 4-bit and int8 layers through PEFT's custom-module API, with a real merge.

Why a registration: PEFT recognises bitsandbytes' layers by ``isinstance(layer, bitsandbytes.nn.Linear4bit)``
(its ``dispatch_bnb_4bit`` / ``dispatch_bnb_8bit``); anygpu's layers are not bitsandbytes classes, so PEFT
takes them for plain ``nn.Linear`` (they subclass it).  Training then works, but ``merge()`` adds the
[out, in] delta to the packed 4-bit bytes and fails.  PEFT's supported route for layers it does not know is
``LoraConfig._register_custom_module({base_class: lora_class})`` (docs: developer_guides/custom_models),
which its dispatcher consults before any built-in one:

    from peft import LoraConfig, get_peft_model
    from anygpu.integrations.peft import register_lora
    config = register_lora(LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    model = get_peft_model(model, config)      # ... train ...
    model = model.merge_and_unload()           # anygpu layers again, with the adapters merged in

The LoRA layers are PEFT's own ``lora.Linear`` (forward, adapters, dropout, scaling, saving unchanged); only
``merge`` / ``unmerge`` differ, as PEFT's bitsandbytes ones do: dequantize the weight, add (or subtract) the
delta, quantize again with the layer's settings.  Merging therefore carries one requantization error.
"""

from __future__ import annotations

import warnings

import torch

from ..nn import Linear4bit, Linear8bitLt


def _lora_linear():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError as exc:  # anygpu does not depend on peft; say what is missing
        raise ImportError("anygpu.integrations.peft needs peft (pip install peft)") from exc
    return Linear


class _QuantizedMerge:
    """merge / unmerge through the base layer's ``dequantize()`` and ``requantize_()``."""

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        from peft.tuners.tuners_utils import check_adapters_to_merge

        for adapter in check_adapters_to_merge(self, adapter_names):
            if adapter not in self.lora_A.keys():
                continue
            base = self.get_base_layer()
            weight = base.dequantize(torch.float32)
            if adapter in self.lora_variant:  # DoRA and the like: their rule, on the dequantized weight
                merged = self.lora_variant[adapter].merge_safe(self, adapter, weight)
            else:
                merged = weight + self.get_delta_weight(adapter).to(weight)
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter} seems to be broken")
            self._set_weight(base, merged)
            if self.lora_bias[adapter]:
                if base.bias is None:
                    raise RuntimeError("Impossible to merge LoRA with `lora_bias=True` because the base layer has "
                                       "no bias.")
                base.bias.data += self.lora_B[adapter].bias * self.scaling[adapter]
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter not in self.lora_A.keys():
                continue
            base = self.get_base_layer()
            weight = base.dequantize(torch.float32)
            if adapter in self.lora_variant:
                weight = self.lora_variant[adapter].unmerge(self, adapter, weight)
            else:
                weight = weight - self.get_delta_weight(adapter).to(weight)
            self._set_weight(base, weight)
            if self.lora_bias[adapter]:
                base.bias.data -= self.lora_B[adapter].bias * self.scaling[adapter]

    @staticmethod
    def _set_weight(base, weight: torch.Tensor) -> None:
        # requantize in the dtype the layer was quantized from (4-bit: its quant_state's; int8: fp16)
        state = getattr(base, "quant_state", None)
        dtype = state.dtype if state is not None else torch.float16
        base.requantize_(weight.to(dtype))


_CLASSES: dict = {}


def lora_classes() -> dict:
    """{anygpu base layer class: its LoRA class} -- PEFT's ``lora.Linear`` with the quantized merge."""
    if not _CLASSES:
        Linear = _lora_linear()
        for base in (Linear4bit, Linear8bitLt):
            name = f"Lora{base.__name__}"
            doc = f"PEFT's lora.Linear over anygpu's {base.__name__}."
            cls = type(name, (_QuantizedMerge, Linear), {"__module__": __name__, "__qualname__": name, "__doc__": doc})
            _CLASSES[base] = cls
    return dict(_CLASSES)


def register_lora(config):
    """Register anygpu's LoRA layers on a ``peft.LoraConfig`` (in place) and return it."""
    Linear = _lora_linear()  # noqa: F841 -- the ImportError first, with its hint
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise ValueError(f"config: expected a peft.LoraConfig, got {type(config).__name__}")
    config._register_custom_module(lora_classes())
    return config
