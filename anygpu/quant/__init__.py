"""bitsandbytes-compatible quantization: 8-bit blockwise, 4-bit NF4 / FP4 with double quantization, and
LLM.int8()'s row-wise int8 (``anygpu.quant.int8``).

Same functions, arguments and results as ``bitsandbytes.functional`` (codes bit-identical to its
reference backend, dequantized values bit-identical), and the same ``QuantState`` serialization, so
checkpoints go both ways.  On the CPU the ops run their PyTorch reference; on CUDA and ROCm GPUs, Triton.

    from anygpu.quant import quantize_4bit, dequantize_4bit
    packed, state = quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    weight_again = dequantize_4bit(packed, state)
"""

from .functional import (dequantize_4bit, dequantize_blockwise, dequantize_fp4, dequantize_nf4, quantize_4bit,
                         quantize_blockwise, quantize_fp4, quantize_nf4)
from .int8 import (int8_linear_matmul, int8_mm_dequant, int8_vectorwise_dequant, int8_vectorwise_quant,
                   matmul_8bit)
from .maps import create_dynamic_map, get_4bit_type
from .state import QuantState

__all__ = ["QuantState", "create_dynamic_map", "dequantize_4bit", "dequantize_blockwise", "dequantize_fp4",
           "dequantize_nf4", "get_4bit_type", "int8_linear_matmul", "int8_mm_dequant", "int8_vectorwise_dequant",
           "int8_vectorwise_quant", "matmul_8bit", "quantize_4bit", "quantize_blockwise", "quantize_fp4",
           "quantize_nf4"]
