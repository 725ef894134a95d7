"""bitsandbytes-compatible optimizers: 8-bit blockwise dynamic-quantized states or fp32 states, torch.optim
conventions, bitsandbytes' class names (``Adam8bit``, ``Adam32bit``, ``Adam`` with ``optim_bits``, ``Paged*``,
LAMB, LARS, Adagrad) and its ``GlobalOptimManager`` per-parameter overrides.

```python
from anygpu.optim import AdamW8bit, PagedAdamW8bit
opt = AdamW8bit(model.parameters(), lr=1e-3)
opt = PagedAdamW8bit(model.parameters(), lr=1e-3)   # states in pinned host memory, streamed per step
```
"""

from .manager import GlobalOptimManager
from .optimizer import QUANT_STATE_KEY, Optimizer8bit
from .optimizers import (AdEMAMix8bit, Adam8bit, AdamW8bit, Lion8bit, PagedAdam8bit, PagedAdamW8bit,
                         PagedAdEMAMix8bit, PagedLion8bit, RMSprop8bit, SGD8bit)
from .optimizers32 import (SGD, AdEMAMix, AdEMAMix32bit, Adam, Adam32bit, AdamW, AdamW32bit, Lion, Lion32bit,
                           PagedAdam, PagedAdam32bit, PagedAdamW, PagedAdamW32bit, PagedAdEMAMix, PagedAdEMAMix32bit,
                           PagedLion, PagedLion32bit, RMSprop, RMSprop32bit, SGD32bit)
from .paging import PAGE_MIN_SIZE, streams_states
from .pytorch_lars import PytorchLARS
from .trust_ratio import LAMB, LARS, Adagrad, Adagrad8bit, Adagrad32bit, LAMB8bit, LAMB32bit, LARS8bit, LARS32bit

__all__ = ["SGD", "AdEMAMix", "AdEMAMix8bit", "AdEMAMix32bit", "Adagrad", "Adagrad8bit", "Adagrad32bit", "Adam",
           "Adam8bit", "Adam32bit", "AdamW", "AdamW8bit", "AdamW32bit", "GlobalOptimManager", "LAMB", "LAMB8bit",
           "LAMB32bit", "LARS", "LARS8bit", "LARS32bit", "Lion", "Lion8bit", "Lion32bit", "Optimizer8bit",
           "PAGE_MIN_SIZE", "PagedAdEMAMix", "PagedAdEMAMix8bit", "PagedAdEMAMix32bit", "PagedAdam", "PagedAdam8bit",
           "PagedAdam32bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit", "PagedLion", "PagedLion8bit",
           "PagedLion32bit", "PytorchLARS", "QUANT_STATE_KEY", "RMSprop", "RMSprop8bit", "RMSprop32bit", "SGD8bit",
           "SGD32bit",
           "streams_states"]
