"""Bridges to other libraries' extension points (PEFT's custom LoRA modules, bitsandbytes' ops).

Each submodule imports its library lazily, on use: ``import anygpu`` never needs peft or bitsandbytes.
"""
