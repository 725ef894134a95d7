"""Checkpoints, configs and tokenizers for the inference engine.

    from anygpu.models import open_checkpoint
    ckpt = open_checkpoint(None)                  # the default model: SmolLM2-135M-Instruct, Q4_1 GGUF
    ckpt.config                                   # ModelConfig
    ids = ckpt.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    for name, tensor in ckpt.weights(): ...       # Hugging Face names, CPU tensors

Supported: decoders of the Llama family and its relatives on one model (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3 text, Phi-3 / Phi-4-mini, SmolLM2; their differences declared in ``families.py``) from a Hugging Face folder
(safetensors), a GGUF file (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS tensors;
byte-level BPE or SentencePiece tokenizer; on the CPU quantized projections and the embedding keep their blocks,
``gguf_packed.py``, everything else is dequantized at load), or a Hugging Face hub id (``org/name``, ``org/name:Q4_K_M``) through the local cache
(``models/resolve.py``).  A folder saved with a bitsandbytes ``quantization_config`` loads its 4-bit / 8-bit linears
as stored (``bnb_load.py``); ``anygpu.nn.save_quantized`` writes such folders.
"""

from .checkpoint import default_model_path, open_checkpoint
from .config import ModelConfig
from .gguf import GGUFCheckpoint
from .hf import HFCheckpoint
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["GGUFCheckpoint", "HFCheckpoint", "IncrementalDetokenizer", "ModelConfig", "Tokenizer",
           "default_model_path", "open_checkpoint"]
