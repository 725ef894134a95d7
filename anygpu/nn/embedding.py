"""bitsandbytes' full-precision embeddings: ``Embedding`` and ``StableEmbedding`` (a LayerNorm after the lookup,
Xavier-uniform init).  Both ask ``GlobalOptimManager`` for 32-bit optimizer states for their weight, as
bitsandbytes does: embeddings see sparse, bursty gradients that 8-bit states quantize badly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..optim.manager import GlobalOptimManager


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: torch.Tensor | None = None, device=None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
                         _weight, device=device)
        GlobalOptimManager.get_instance().register_module_override(self, "weight", {"optim_bits": 32})

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)
        self._fill_padding_idx_with_zero()


class StableEmbedding(Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: torch.Tensor | None = None, device=None, dtype=None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
                         _weight, device)
        if dtype is not None:
            self.weight.data = self.weight.data.to(dtype)
        self.norm = nn.LayerNorm(embedding_dim, device=device)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        # the LayerNorm always runs in the default (full) precision, as bitsandbytes does
        return self.norm(emb.to(torch.get_default_dtype())).to(self.weight.dtype)
