"""``EngineStats``: a snapshot of an engine's load, what ``/metrics`` reports at scrape time.

A frozen value rather than live views of the scheduler and block manager: an engine in another process
(``engine_process.py``) has neither here, only the numbers it sent with its last step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # requests waiting to be scheduled
    num_blocks: int = 0  # KV-cache blocks in all
    num_free_blocks: int = 0  # of which free (cached-but-unused blocks count as free: they are evictable)

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of KV-cache blocks in use, 0 to 1."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0
