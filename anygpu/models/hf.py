"""``HFCheckpoint``: a Hugging Face model folder (config.json, *.safetensors, tokenizer.json) as config, tokenizer and
weights.

    ckpt = HFCheckpoint("path/to/SmolLM2-135M-Instruct")
    for name, w in ckpt.weights():      # ("model.embed_tokens.weight", bf16 [49152, 576]), ... in the stored dtype

Only safetensors are read: ``pytorch_model.bin`` files are pickles, which can run code when loaded, so they are
refused (convert them with transformers' ``save_pretrained(..., safe_serialization=True)``).  A bitsandbytes
checkpoint (``quantization_config`` in config.json, or bitsandbytes tensors saved by a plain ``save_pretrained``,
which writes none) yields its packed weights and quant-state items as stored.  The eos ids of
config.json, generation_config.json (instruct models often list several there) and the tokenizer are merged, so
generation stops on any of them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import torch

from .._progress import disabled
from .bnb_config import infer_from_tensors
from .bnb_weights import unpacked_shapes
from .config import HF_KEYS, ModelConfig
from .config_checks import check_eos_ids
from .folder_files import file_in_folder, read_json
from .safetensors_header import TensorEntry, read_header
from .shape_check import check_tensor_shapes, expected_shapes
from .tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"


class HFCheckpoint:
    def __init__(self, folder: str | Path):
        self.path = Path(folder)
        self.name = self.path.resolve().name
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such model folder")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{self.path}: no config.json; a Hugging Face model folder holds config.json, "
                                    "*.safetensors and tokenizer.json")
        config = ModelConfig.from_hf(read_json(config_path), where=str(config_path))
        self.files = self._safetensors_files()
        # Every header read and checked against its file (and the config against the tensors) before a byte of
        # weights is: a lying header or config is an error naming the file here, not a huge allocation later.
        self.headers: dict[Path, dict[str, TensorEntry]] = {f: read_header(f) for f in self.files}
        shapes: dict[str, tuple[int, ...]] = {}
        for f, tensors in self.headers.items():
            for name, entry in tensors.items():
                if name in shapes:
                    raise ValueError(f"{f}: tensor {name!r} is also in another file of {self.path}")
                shapes[name] = entry.shape
        if config.quantization is None:  # bitsandbytes tensors saved without their quantization_config
            config = dataclasses.replace(config, quantization=infer_from_tensors(shapes))
        if config.quantization is not None:  # packed 4-bit weights: checked by byte count, then as [out, in]
            nbytes = {n: e.end - e.begin for tensors in self.headers.values() for n, e in tensors.items()}
            shapes = unpacked_shapes(shapes, nbytes, expected_shapes(config), str(self.path))
        check_tensor_shapes(config, shapes, where=str(self.path), config_where=str(config_path), keys=HF_KEYS)
        # A folder of weights alone still runs on token ids (a tokenizer.model without tokenizer.json is refused
        # by from_hf_folder: that is a tokenizer we cannot read, not a missing one).
        has_tokenizer = (self.path / "tokenizer.json").is_file() or (self.path / "tokenizer.model").exists()
        self.tokenizer = Tokenizer.from_hf_folder(self.path) if has_tokenizer else None
        eos = list(config.eos_token_ids)
        generation = self.path / "generation_config.json"
        if generation.is_file():
            eos += check_eos_ids(read_json(generation).get("eos_token_id"), "eos_token_id", str(generation))
        eos += list(self.tokenizer.eos_token_ids) if self.tokenizer else []
        eos = tuple(dict.fromkeys(int(i) for i in eos))
        self.config = dataclasses.replace(config, eos_token_ids=eos)
        if self.tokenizer is not None:
            self.tokenizer.eos_token_ids = eos

    def _safetensors_files(self) -> list[Path]:
        index = self.path / _INDEX
        if index.is_file():  # sharded: the index maps every tensor to its shard
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: weight_map: expected an object of tensor name -> shard file name, "
                                 f"got {weight_map!r:.100}")
            shards = dict.fromkeys(weight_map.values())
            files = [file_in_folder(self.path, f, where=f"{index}: weight_map") for f in shards]
            missing = [str(f.relative_to(self.path)) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{self.path}: {_INDEX} lists missing shards: {', '.join(missing)}")
            return files
        files = sorted(p for p in self.path.glob("*.safetensors") if p.is_file())
        if files:
            return files
        pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        if pickles:
            raise ValueError(f"{self.path}: no *.safetensors, only {', '.join(pickles)}: PyTorch .bin/.pt files are "
                             "pickles, which can run code when loaded, so they are refused for safety; convert the "
                             "model to safetensors")
        raise FileNotFoundError(f"{self.path}: no *.safetensors weight files")

    def weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(name as stored, CPU tensor in its stored dtype) for every tensor of every file; the iterator's
        ``where`` is the folder, for a loader's errors."""
        return NamedWeights(self._weights(progress), str(self.path))

    def _weights(self, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open
        from tqdm.auto import tqdm

        total = sum(len(tensors) for tensors in self.headers.values())
        with tqdm(total=total, desc=f"Loading {self.name}", unit="tensor", disable=disabled(progress)) as bar:
            for f, tensors in self.headers.items():
                try:  # the header passed read_header; this catches a file changed since it was opened
                    with safe_open(f, framework="pt") as sf:
                        for key in tensors:
                            bar.update()
                            if key.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                                continue
                            yield key, sf.get_tensor(key)
                except (SafetensorError, OSError) as e:
                    raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from e


class NamedWeights:
    """An iterator of (name, tensor) that says where it reads from (``where``): errors about a tensor met while
    loading (``bnb_load``) name the checkpoint, though the loader only sees the stream."""

    def __init__(self, items: Iterator[tuple[str, torch.Tensor]], where: str):
        self._items, self.where = items, where

    def __iter__(self):
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._items)
