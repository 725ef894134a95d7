"""Index and metadata tensors given as strided views (position_ids[:, -1], a column of a slot table, a
block-table slice): every launcher must read them as the references index them."""

import torch

from anygpu.ops.paged_decode import reference as decode_reference
from anygpu.ops.reshape_and_cache import reference as cache_reference
from anygpu.ops.rotary_embedding import reference as rotary_reference
from anygpu.ops.rotary_embedding import rotary_cos_sin_cache


def test_rotary_reads_strided_positions(kdevice):
    from anygpu.kernels.rotary_embedding import rotary_embedding

    tokens = 5
    positions = torch.tensor([[0, 3], [1, 9], [2, 4], [3, 7], [4, 1]], device=kdevice)[:, 1]  # stride 2
    q = torch.randn(tokens, 4, 16, device=kdevice)
    k = torch.randn(tokens, 2, 16, device=kdevice)
    cache = rotary_cos_sin_cache(16, 16, device=kdevice)
    q2, k2 = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache, True)
    rotary_reference(positions.contiguous(), q2, k2, cache, True)
    torch.testing.assert_close(q, q2)
    torch.testing.assert_close(k, k2)


def test_kv_write_reads_a_strided_slot_mapping(kdevice):
    from anygpu.kernels.kv_cache import reshape_and_cache

    key, value = torch.randn(2, 3, 2, 8, device=kdevice).unbind(0)
    slots = torch.tensor([[5, 0], [-1, 0], [12, 0]], device=kdevice)[:, 0]  # stride 2
    caches = [torch.zeros(4, 4, 2, 8, device=kdevice) for _ in range(4)]
    reshape_and_cache(key, value, caches[0], caches[1], slots)
    cache_reference(key, value, caches[2], caches[3], slots.contiguous())
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_decode_reads_strided_seqlens_and_block_tables(kdevice):
    from anygpu.kernels.paged_decode import paged_decode

    key_cache = torch.randn(8, 4, 1, 16, device=kdevice)
    value_cache = torch.randn(8, 4, 1, 16, device=kdevice)
    tables = torch.tensor([[3, 9, 1, 9, 6], [0, 9, 2, 9, 7]], dtype=torch.int32, device=kdevice)[:, ::2]  # stride 2
    seqlens = torch.tensor([[10, 0], [7, 0]], dtype=torch.int32, device=kdevice)[:, 0]
    q = torch.randn(2, 2, 16, device=kdevice)
    out = paged_decode(q, key_cache, value_cache, tables, seqlens, 12)
    expected = decode_reference(q, key_cache, value_cache, tables.contiguous(), seqlens.contiguous(), 12)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
