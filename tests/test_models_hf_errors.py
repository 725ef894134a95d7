"""Hugging Face folders that lie (issue 21, items 5 and 6): every error is a ValueError naming the file and what was
expected, never a raw traceback or a huge allocation; and a folder can only open files inside itself.

The folders are real: config.json written as JSON text, weights written by the safetensors package, a
tokenizer.json saved by the tokenizers package; then the bytes are corrupted the way the probe did.
"""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from anygpu.models import HFCheckpoint, open_checkpoint
from anygpu.models.safetensors_header import MAX_HEADER_BYTES, read_header

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
          "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def _tensors():
    """A 2-layer Llama of hidden 32 (2 heads of 16, 1 kv head), by hand: the shapes transformers would save."""
    t = {"model.embed_tokens.weight": (64, 32), "model.norm.weight": (32,)}
    for i in range(2):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
              p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (16, 32),
              p + "self_attn.v_proj.weight": (16, 32), p + "self_attn.o_proj.weight": (32, 32),
              p + "mlp.gate_proj.weight": (48, 32), p + "mlp.up_proj.weight": (48, 32),
              p + "mlp.down_proj.weight": (32, 48)}
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in t.items()}


def make_folder(path, config=None, tokenizer=True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or CONFIG))
    save_file(_tensors(), str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer:
        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(path / "tokenizer.json"))
    return path


def _header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _rewrite(path, header, data):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_the_folder_loads(tmp_path):
    """The fixture itself is good: everything below fails only because of its one corruption."""
    ckpt = HFCheckpoint(make_folder(tmp_path / "m"))
    assert (ckpt.config.num_layers, ckpt.config.vocab_size, ckpt.config.head_dim) == (2, 64, 16)
    got = dict(ckpt.weights(progress=False))
    assert all(torch.equal(got[k], v) for k, v in _tensors().items()) and got.keys() == _tensors().keys()
    assert ckpt.tokenizer.encode("w3 w5") == [3, 5]


def _expect(folder, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        HFCheckpoint(folder)
    return str(info.value)


# --- lying safetensors headers ---

def test_header_length_2_pow_40(tmp_path):
    f = make_folder(tmp_path / "m") / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    msg = _expect(f.parent, "header length 1099511627776 is over the 100000000-byte limit")
    assert str(f) in msg


def test_header_length_past_eof(tmp_path):
    f = make_folder(tmp_path / "m") / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])  # under the limit, but more than the file holds
    assert str(f) in _expect(f.parent, "header length .* runs past the end of the .*-byte file")


def test_header_bad_json(tmp_path):
    f = make_folder(tmp_path / "m") / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:12] = b"{{{{"
    f.write_bytes(bytes(raw))
    assert str(f) in _expect(f.parent, "safetensors header is not valid JSON")


@pytest.mark.parametrize("blob, pattern", [(b"[1, 2, 3]", "expected a JSON object, got list"),
                                           (b"\xff\xfe{}", "not valid JSON"),
                                           (b"[" * 100_000, "not valid JSON")])
def test_header_not_an_object(tmp_path, blob, pattern):
    f = make_folder(tmp_path / "m") / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert str(f) in _expect(f.parent, pattern)


def test_tensor_offsets_past_eof(tmp_path):
    f = make_folder(tmp_path / "m") / "model.safetensors"
    header, data = _header(f)
    header["model.norm.weight"]["data_offsets"][1] += 1 << 40
    _rewrite(f, header, data)
    assert str(f) in _expect(f.parent, r"tensor 'model.norm.weight': data_offsets .* run past the end of the data")


def test_truncated_file(tmp_path):
    f = make_folder(tmp_path / "m") / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:-10])
    msg = _expect(f.parent, "run past the end of the data .*truncated")
    assert str(f) in msg
    f.write_bytes(raw[:5])
    assert str(f) in _expect(f.parent, "5 bytes, shorter than the 8-byte header length")


@pytest.mark.parametrize("field, value, pattern", [
    ("dtype", "F33", "dtype: expected one of"),
    ("shape", [4, -1], "shape: expected a list of at most 8 non-negative ints"),
    ("shape", [64, 33], r"data_offsets .* hold 128 bytes, but F32 \(64, 33\) needs 8448"),
    ("data_offsets", [8, 4], r"data_offsets: expected \[begin, end\] with 0 <= begin <= end"),
    ("data_offsets", "0-128", r"data_offsets: expected \[begin, end\]"),
])
def test_tensor_entry_lies(tmp_path, field, value, pattern):
    f = make_folder(tmp_path / "m") / "model.safetensors"
    header, data = _header(f)
    header["model.norm.weight"][field] = value
    _rewrite(f, header, data)
    assert str(f) in _expect(f.parent, "tensor 'model.norm.weight': " + pattern)


def test_tensors_overlap_or_leave_gaps(tmp_path):
    f = make_folder(tmp_path / "m") / "model.safetensors"
    header, data = _header(f)
    entries = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    (b0, e0), first = entries[0]
    (b1, e1), second = entries[1]
    header[second]["data_offsets"] = [b1 - 4, e1 - 4]  # shares 4 bytes with the first, leaves 4 after it
    _rewrite(f, header, data)
    assert str(f) in _expect(f.parent, f"tensor '{second}' .* overlaps tensor '{first}'")
    header[second]["data_offsets"] = [b1, e1]
    _rewrite(f, header, data + b"\0" * 16)
    _expect(f.parent, "trailing bytes after the last tensor")


def test_duplicate_tensor_in_header(tmp_path):
    f = make_folder(tmp_path / "m") / "model.safetensors"
    header, data = _header(f)
    blob = json.dumps(header).encode()
    entry = json.dumps({"model.norm.weight": header["model.norm.weight"]}).encode()[1:-1]
    blob = blob[:-1] + b", " + entry + b"}"  # the same name twice: json.loads would keep only the last
    f.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    _expect(f.parent, "'model.norm.weight' is listed twice")


def test_read_header_bounds_what_it_reads(tmp_path):
    """The lying length is refused before a byte of it is read: nothing near 2^40 bytes is ever allocated."""
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(ValueError, match="over the 100000000-byte limit"):
        read_header(f)


# --- other files of the folder ---

def test_invalid_tokenizer_json(tmp_path):
    folder = make_folder(tmp_path / "m")
    (folder / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    assert str(folder / "tokenizer.json") in _expect(folder, "not a readable tokenizer.json")
    (folder / "tokenizer.json").write_text("{not json")
    _expect(folder, "tokenizer.json: not a readable tokenizer.json")


def test_bad_config_json(tmp_path):
    folder = make_folder(tmp_path / "m")
    (folder / "config.json").write_text('{"hidden_size": 32,')
    assert str(folder / "config.json") in _expect(folder, "config.json: not valid JSON")
    (folder / "config.json").write_bytes(b'{"hidden_size": "\xff"}')
    _expect(folder, "config.json: not UTF-8 text")
    (folder / "config.json").write_text("[]")
    _expect(folder, "config.json: expected a JSON object, got list")


def test_num_attention_heads_zero(tmp_path):
    folder = make_folder(tmp_path / "m", {**CONFIG, "num_attention_heads": 0})
    msg = _expect(folder, r"num_attention_heads: expected an int in \[1, 1024\], got 0")
    assert str(folder / "config.json") in msg


def test_missing_hidden_size(tmp_path):
    config = {k: v for k, v in CONFIG.items() if k != "hidden_size"}
    msg = _expect(make_folder(tmp_path / "m", config), "hidden_size: missing, and it is required")
    assert "config.json" in msg


@pytest.mark.parametrize("name, text, pattern", [
    ("tokenizer_config.json", "{oops", "tokenizer_config.json: not valid JSON"),
    ("tokenizer_config.json", '{"eos_token": 7}', r"tokenizer_config.json: eos_token: expected a string"),
    ("generation_config.json", "[1, 2]", "generation_config.json: expected a JSON object"),
    ("generation_config.json", '{"eos_token_id": "2"}', r"generation_config.json: eos_token_id: expected an int"),
    ("chat_template.json", '{"chat_template": 5}', "chat_template.json: chat_template: expected a string"),
    ("model.safetensors.index.json", "{", "model.safetensors.index.json: not valid JSON"),
    ("model.safetensors.index.json", '{"weight_map": []}', "index.json: weight_map: expected an object"),
    ("model.safetensors.index.json", '{"weight_map": {"a": 7}}', "expected a file name inside the model folder"),
])
def test_bad_side_files(tmp_path, name, text, pattern):
    folder = make_folder(tmp_path / "m")
    (folder / name).write_text(text)
    assert str(folder / name) in _expect(folder, pattern)


def test_huge_json_refused_before_reading(tmp_path):
    folder = make_folder(tmp_path / "m")
    with open(folder / "config.json", "r+b") as f:
        f.truncate(65 << 20)  # sparse: no disk used, but 65 MiB to read
    _expect(folder, r"config.json: \d+ bytes, over the 67108864-byte limit")


# --- item 6: a folder opens files inside itself only ---

def _index(folder, shard_name):
    names = list(_tensors())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, shard_name)}))


@pytest.mark.parametrize("shard", ["../other/model.safetensors", "sub/../../other/model.safetensors", "ABS"])
def test_index_cannot_point_outside(tmp_path, shard):
    other = make_folder(tmp_path / "other")  # a valid model the index would otherwise load
    folder = make_folder(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    _index(folder, str(other / "model.safetensors") if shard == "ABS" else shard)
    msg = _expect(folder, "is outside the model folder .* may only name files inside itself")
    assert "model.safetensors.index.json" in msg
    with pytest.raises(ValueError, match="outside the model folder"):
        open_checkpoint(folder)


def test_index_into_subfolder_and_symlinked_shard(tmp_path):
    """What stays allowed: a relative path under the folder, and a symlinked shard (the Hugging Face cache keeps
    snapshots/<rev>/model.safetensors as a symlink to blobs/<sha>, outside the snapshot folder)."""
    folder = make_folder(tmp_path / "snapshots" / "rev")
    (folder / "weights").mkdir()
    (folder / "model.safetensors").rename(folder / "weights" / "model.safetensors")
    _index(folder, "weights/model.safetensors")
    assert len(dict(HFCheckpoint(folder).weights(progress=False))) == len(_tensors())
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (folder / "weights" / "model.safetensors").rename(blobs / "abc123")
    os.symlink(blobs / "abc123", folder / "model.safetensors")
    _index(folder, "model.safetensors")
    assert len(dict(HFCheckpoint(folder).weights(progress=False))) == len(_tensors())
