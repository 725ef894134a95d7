"""``BlockManager``: the pool of KV-cache blocks, reference counts and the prefix cache.

A block holds ``block_size`` consecutive tokens of one sequence; ``seq.block_table[i]`` holds tokens
``[i * block_size, (i + 1) * block_size)``.  Block tables are append-only while a sequence holds blocks.

Prefix caching (vLLM's automatic prefix caching, on full blocks only):

- A full block whose tokens are all computed is registered under a chained hash,
  ``blake2b(parent hash + the block's token ids)``, so a hash names the whole prefix up to that block.
  A hit is trusted only after comparing the stored token ids and parent hash: a collision cannot hand a
  sequence someone else's K/V.
- Blocks are reference counted; sequences with a common prefix share its blocks.
- A block whose count drops to 0 goes to the free list but keeps its hash: a later request with that prefix
  revives it.  The free list is an LRU (an OrderedDict, evicted from the front): blocks without a hash go to
  the front (nothing to lose), hashed ones to the back, a sequence's blocks last-first so that the tail of a
  prefix is evicted before its head (vLLM's order).  Taking a fresh block evicts the front one and drops
  its hash.  ``num_free_blocks`` counts cached-but-unused blocks as free: they are evictable.
- ``allocate`` never marks a whole sequence as cached: the last token is always computed, so the step has
  logits to sample from.  So at most ``(num_tokens - 1) // block_size`` blocks are hits.

Admission reserves blocks for all of a sequence's current tokens (hits plus fresh blocks), all or nothing:
a chunked prefill then never needs blocks midway, and only decodes grow a table (``ensure_slots``), which is
where the scheduler preempts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .sequence import Sequence


def hash_block(parent: bytes, token_ids) -> bytes:
    """The chained hash of a full block: its parent's hash (b"" for the first block) and its token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected an int >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Per block, while registered in the cache: its hash, and (parent hash, token ids) to verify a hit.
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._block_key: list[tuple | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the blocks held by sequences."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cache_hits(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached blocks (and their hashes) holding seq's leading full blocks, leaving the last token out."""
        hits, hashes = [], []
        # Prompt log-probabilities need the logits of every prompt position, so a cached block is no use to them.
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return hits, hashes
        bs, parent = self.block_size, b""
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_range(i * bs, (i + 1) * bs))
            h = hash_block(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self._block_key[block] != (parent, tokens):
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        return hits, hashes

    def _take_fresh(self) -> int:
        """The least recently freed block, its old cache entry dropped."""
        block, _ = self._free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hash[block] = self._block_key[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence) -> bool:
        """Give a sequence without blocks the blocks for all its tokens, reusing cached prefix blocks.

        Sets num_computed_tokens to the tokens found in the cache.  False, and nothing changed, when the
        free blocks are short (revived hits count against the free list: they leave it)."""
        if seq.block_table:
            raise ValueError(f"allocate: sequence {seq.seq_id} already holds blocks")
        hits, hashes = self._cache_hits(seq)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        if fresh + revived > len(self._free):
            return False
        for block in hits:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        seq.block_table = hits + [self._take_fresh() for _ in range(fresh)]
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(hits) * self.block_size
        if not seq.output_token_ids:  # stats: the prompt's hits at its first admission
            seq.num_cached_tokens = seq.num_computed_tokens
        return True

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's table to hold num_computed_tokens + num_new_tokens; False (no change) if blocks are short."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        seq.block_table.extend(self._take_fresh() for _ in range(need))
        return True

    def commit(self, seq: Sequence) -> None:
        """Register seq's blocks that are full and fully computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, seq.num_tokens, len(seq.block_table) * bs) // bs
        if full <= len(seq.block_hashes):  # most steps: no block filled up
            return
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
            tokens = tuple(seq.token_range(i * bs, (i + 1) * bs))
            h = hash_block(parent, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            # Another block may already hold this prefix (two sequences prefilled it at once): keep that
            # entry; this block stays unregistered and is reused plainly once free.
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
                self._block_key[block] = (parent, tokens)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; unreferenced blocks join the free list (hashed ones stay findable)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
