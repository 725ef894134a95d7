"""``HFCheckpoint``: a Hugging Face model folder (config.json, *.safetensors, tokenizer.json) as config, tokenizer and
weights.

    ckpt = HFCheckpoint("path/to/SmolLM2-135M-Instruct")
    for name, w in ckpt.weights():      # ("model.embed_tokens.weight", bf16 [49152, 576]), ... in the stored dtype

Only safetensors are read: ``pytorch_model.bin`` files are pickles, which can run code when loaded, so they are
refused (convert them with transformers' ``save_pretrained(..., safe_serialization=True)``).  The eos ids of
config.json, generation_config.json (instruct models often list several there) and the tokenizer are merged, so
generation stops on any of them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterator

import torch

from .config import ModelConfig
from .tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"


class HFCheckpoint:
    def __init__(self, folder: str | Path):
        self.path = Path(folder)
        self.name = self.path.resolve().name
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such model folder")
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path}: no config.json; a Hugging Face model folder holds config.json, "
                                    "*.safetensors and tokenizer.json")
        config = ModelConfig.from_hf(json.loads((self.path / "config.json").read_text(encoding="utf-8")))
        self.files = self._safetensors_files()
        # A folder of weights alone still runs on token ids (a tokenizer.model without tokenizer.json is refused
        # by from_hf_folder: that is a tokenizer we cannot read, not a missing one).
        has_tokenizer = (self.path / "tokenizer.json").is_file() or (self.path / "tokenizer.model").exists()
        self.tokenizer = Tokenizer.from_hf_folder(self.path) if has_tokenizer else None
        eos = list(config.eos_token_ids)
        generation = self.path / "generation_config.json"
        if generation.is_file():
            value = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
            if value is not None:
                eos += value if isinstance(value, list) else [value]
        eos += list(self.tokenizer.eos_token_ids) if self.tokenizer else []
        eos = tuple(dict.fromkeys(int(i) for i in eos))
        self.config = dataclasses.replace(config, eos_token_ids=eos)
        if self.tokenizer is not None:
            self.tokenizer.eos_token_ids = eos

    def _safetensors_files(self) -> list[Path]:
        index = self.path / _INDEX
        if index.is_file():  # sharded: the index maps every tensor to its shard
            shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
            files = [self.path / f for f in dict.fromkeys(shards)]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{self.path}: {_INDEX} lists missing shards: {', '.join(missing)}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        if pickles:
            raise ValueError(f"{self.path}: no *.safetensors, only {', '.join(pickles)}: PyTorch .bin/.pt files are "
                             "pickles, which can run code when loaded, so they are refused for safety; convert the "
                             "model to safetensors")
        raise FileNotFoundError(f"{self.path}: no *.safetensors weight files")

    def weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(name as stored, CPU tensor in its stored dtype) for every tensor of every file."""
        from safetensors import safe_open
        from tqdm.auto import tqdm

        total = 0
        for f in self.files:  # reads the headers only
            with safe_open(f, framework="pt") as sf:
                total += len(sf.keys())
        with tqdm(total=total, desc=f"Loading {self.name}", unit="tensor", disable=not progress) as bar:
            for f in self.files:
                with safe_open(f, framework="pt") as sf:
                    for key in sf.keys():
                        bar.update()
                        if key.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved, not a weight
                            continue
                        yield key, sf.get_tensor(key)
