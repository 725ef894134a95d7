"""bitsandbytes-compatible 4-bit and int8 modules, and ``quantize_model`` to turn any model's ``nn.Linear`` layers
into them.

    from anygpu.nn import Linear4bit, Params4bit, quantize_model
    report = quantize_model(model, "nf4")            # every nn.Linear but lm_head, in place
    report = quantize_model(model, "int8", threshold=6.0)   # LLM.int8(): Linear8bitLt
    print(report)                                     # layers replaced, parameter bytes before / after
    save_quantized(model, "folder")                   # a folder transformers + bitsandbytes and anygpu load

Same constructors, attributes and state_dict keys as ``bitsandbytes.nn`` (a checkpoint saved by one loads
into the other); the matmul is ``anygpu.quant.matmul.matmul_4bit``, Triton on CUDA and ROCm, PyTorch on
the CPU; ``Linear8bitLt`` / ``Int8Params`` compute with ``anygpu.quant.int8.matmul_8bit``.  Gradients flow
through the frozen 4-bit and int8 weights to the inputs, so LoRA adapters train on top (QLoRA).
"""

from .embedding import Embedding, StableEmbedding
from .embedding_quantized import Embedding4bit, Embedding8bit, EmbeddingFP4, EmbeddingNF4
from .int8params import Int8Params
from .linear4bit import Linear4bit, LinearFP4, LinearNF4
from .linear8bit import Linear8bitLt
from .params4bit import Params4bit
from .quantize_model import QuantizeReport, quantize_model
from .save_quantized import save_quantized

__all__ = ["Embedding", "Embedding4bit", "Embedding8bit", "EmbeddingFP4", "EmbeddingNF4", "StableEmbedding",
           "Int8Params", "Linear4bit", "Linear8bitLt", "LinearFP4", "LinearNF4", "Params4bit", "QuantizeReport",
           "quantize_model", "save_quantized"]
