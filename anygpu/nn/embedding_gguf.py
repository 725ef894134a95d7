"""``GGUFEmbedding``: an embedding table kept as its GGUF blocks; a lookup decodes only the rows it reads.

Why: on the CPU the default model's table (49152 x 576) is 113 MB in fp32 against 30 MB as Q8_0, and a decode
step reads one row of it.  Values are the GGUF's exactly (``anygpu.quant.gguf_blocks``), in ``dtype``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quant.gguf_blocks import BLOCK_SHAPES, dequantize_blocks


class GGUFEmbedding(nn.Module):
    def __init__(self, blocks: torch.Tensor, type_name: str, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        per_block, size = BLOCK_SHAPES[type_name]
        if embedding_dim % per_block or blocks.numel() != num_embeddings * embedding_dim // per_block * size:
            raise ValueError(f"blocks: expected {num_embeddings} rows of {embedding_dim} {type_name} values, got "
                             f"{blocks.numel()} bytes")
        self.type_name, self.num_embeddings, self.embedding_dim, self.dtype = (type_name, num_embeddings,
                                                                              embedding_dim, dtype)
        self.register_buffer("blocks", blocks.reshape(num_embeddings, -1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))
        out = torch.empty(rows.shape[0] * self.embedding_dim, dtype=self.dtype, device=rows.device)
        dequantize_blocks(rows.reshape(-1), self.type_name, out=out)
        return out.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name}"
