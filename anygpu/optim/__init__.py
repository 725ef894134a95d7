"""bitsandbytes-compatible 8-bit optimizers: blockwise dynamic-quantized states, torch.optim conventions.

```python
from anygpu.optim import AdamW8bit
opt = AdamW8bit(model.parameters(), lr=1e-3)
```
"""

from .optimizer import QUANT_STATE_KEY, Optimizer8bit
from .optimizers import AdEMAMix8bit, Adam8bit, AdamW8bit, Lion8bit, RMSprop8bit, SGD8bit

__all__ = ["AdEMAMix8bit", "Adam8bit", "AdamW8bit", "Lion8bit", "Optimizer8bit", "QUANT_STATE_KEY", "RMSprop8bit", "SGD8bit"]
