"""bitsandbytes-compatible 8-bit optimizers: blockwise dynamic-quantized states, torch.optim conventions.

```python
from anygpu.optim import AdamW8bit, PagedAdamW8bit
opt = AdamW8bit(model.parameters(), lr=1e-3)
opt = PagedAdamW8bit(model.parameters(), lr=1e-3)   # states in pinned host memory, streamed per step
```
"""

from .optimizer import QUANT_STATE_KEY, Optimizer8bit
from .optimizers import (AdEMAMix8bit, Adam8bit, AdamW8bit, Lion8bit, PagedAdam8bit, PagedAdamW8bit,
                         PagedAdEMAMix8bit, PagedLion8bit, RMSprop8bit, SGD8bit)
from .paging import PAGE_MIN_SIZE, streams_states

__all__ = ["AdEMAMix8bit", "Adam8bit", "AdamW8bit", "Lion8bit", "Optimizer8bit", "PAGE_MIN_SIZE", "PagedAdEMAMix8bit",
           "PagedAdam8bit", "PagedAdamW8bit", "PagedLion8bit", "QUANT_STATE_KEY", "RMSprop8bit", "SGD8bit",
           "streams_states"]
