"""bitsandbytes' quantized embeddings: ``Embedding8bit`` (row-wise int8, LLM.int8()'s weight format) and
``Embedding4bit`` / ``EmbeddingNF4`` / ``EmbeddingFP4`` (blockwise 4-bit, QLoRA's format).

As in bitsandbytes: the weight is quantized on the module's first move to a device (here the CPU too, and
at the latest on the first forward, where it is); a lookup dequantizes only the rows it reads (4-bit: when
``embedding_dim`` is a multiple of the blocksize, so each row owns whole blocks; else the whole table); the
output has the dtype the layer was built with; saving a state_dict is refused, as bitsandbytes refuses it
(no checkpoint format is defined for these layers).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.functional import _plain_absmax, dequantize_4bit
from ..quant.state import QuantState
from .int8params import Int8Params
from .params4bit import Params4bit


class Embedding8bit(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.dtype = self.weight.data.dtype
        self.weight = Int8Params(self.weight.data, has_fp16_weights=False, requires_grad=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        raise NotImplementedError("Embedding8bit: saving is not implemented (as in bitsandbytes)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.dtype != torch.int8:
            if weight.device.type == "meta":
                raise ValueError("weight: on the meta device; move the layer to a device first")
            weight._quantize(weight.device)
        rows = F.embedding(input, weight.data)
        scales = F.embedding(input, weight.SCB.view(self.num_embeddings, 1))
        return (rows * (scales / 127.0)).to(self.dtype)


class Embedding4bit(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None, quant_type: str = "fp4",
                 quant_storage: torch.dtype = torch.uint8, device=None):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.dtype = self.weight.data.dtype
        self.weight = Params4bit(self.weight.data, requires_grad=False, compress_statistics=False,
                                 quant_type=quant_type, quant_storage=quant_storage, module=self)
        self.quant_state = None
        if embedding_dim % self.weight.blocksize != 0:
            warnings.warn(f"Embedding4bit: embedding_dim {embedding_dim} is not a multiple of the blocksize "
                          f"{self.weight.blocksize}: every lookup dequantizes the whole table", UserWarning,
                          stacklevel=2)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        raise NotImplementedError("Embedding4bit: saving is not implemented (as in bitsandbytes)")

    def _state(self) -> QuantState:
        weight = self.weight
        if weight.quant_state is None:
            if weight.device.type == "meta":
                raise ValueError("weight: on the meta device; move the layer to a device first")
            weight._quantize(weight.device)
        return weight.quant_state

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        state = self._state()
        if self.embedding_dim % state.blocksize:
            table = dequantize_4bit(self.weight.data, state)
            return F.embedding(input, table).to(self.dtype)
        blocks = self.embedding_dim // state.blocksize
        packed = self.weight.data.view(torch.uint8).view(self.num_embeddings, self.embedding_dim // 2)
        rows = F.embedding(input.reshape(-1), packed)
        absmax = _plain_absmax(state).view(self.num_embeddings, blocks)[input.reshape(-1)]
        picked = QuantState(absmax=absmax.reshape(-1), shape=torch.Size((rows.shape[0], self.embedding_dim)),
                            dtype=state.dtype, blocksize=state.blocksize, quant_type=state.quant_type)
        out = dequantize_4bit(rows.reshape(-1, 1), picked)
        return out.view(*input.shape, self.embedding_dim).to(self.dtype)


class EmbeddingFP4(Embedding4bit):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None, quant_storage: torch.dtype = torch.uint8,
                 device=None):
        super().__init__(num_embeddings, embedding_dim, dtype, "fp4", quant_storage, device)


class EmbeddingNF4(Embedding4bit):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None, quant_storage: torch.dtype = torch.uint8,
                 device=None):
        super().__init__(num_embeddings, embedding_dim, dtype, "nf4", quant_storage, device)
