"""The inference engine: requests in, tokens out (continuous batching over a paged KV cache).

``LLM`` is the offline API, ``LLMEngine`` the step-at-a-time engine, ``AsyncLLMEngine`` its streaming form for
a server.  Inside: ``SamplingParams`` and ``Sequence`` describe a request; ``BlockManager`` owns the KV blocks
and the prefix cache; ``Scheduler`` picks each step's tokens; ``ModelRunner`` runs the model; ``Sampler`` turns
logits into tokens.  Design and decisions: docs/design/engine.md.
"""

from .async_engine import AsyncLLMEngine
from .block_manager import BlockManager
from .errors import EngineDead, RequestFailed, RequestInvalid
from .llm import LLM
from .llm_engine import LLMEngine, RequestOutput
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus

__all__ = ["LLM", "AsyncLLMEngine", "BlockManager", "EngineDead", "LLMEngine", "RequestFailed", "RequestInvalid",
           "RequestOutput", "Sampler", "SamplingParams", "ScheduledBatch", "Scheduler", "Sequence", "SequenceStatus"]
