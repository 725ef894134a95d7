"""SentencePiece-vocabulary GGUFs (``tokenizer.ggml.model == "llama"``: Llama-2, Mistral v0.1, TinyLlama...)
(issue 23) on tests/data/tiny-spm-llama.gguf (tests/data/README.md says how it was made): ids and text equal to
transformers' own GGUF loading (the oracle) and to sentencepiece on the source .model, streamed text, chat
template, logits and greedy tokens of the engine equal to transformers', the CLI end to end, and errors that name
the broken key."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anygpu.models import GGUFCheckpoint, IncrementalDetokenizer, Tokenizer
from anygpu.models.gguf_file import read_gguf

DATA = Path(__file__).parent / "data"
NAME = "tiny-spm-llama.gguf"
FILE = DATA / NAME

TEXTS = [
    "Hello world", "The engine runs GGUF files.", "  leading and   multiple spaces\n\n\ttabs\r\n", " one leading space",
    "2024 digits 12345.678 and 3,141,592", "héllo wörld ñ 日本語のテキスト 中文 한국어", "Привет, мир!",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷", "<|im_start|>user\nhi<|im_end|>\n</s> <s><unk>", "<tool>call<tool>x", "it's don't I'll",
    "x" * 300, "", " ", "\n", "▁already▁metaspace", "[PAD3] [PAD1000]", "\x00\x01 control \x7f", "a\u00a0b\u2003c",
    "<0x0A> literal", "Ω≈ç√∫˜µ≤≥÷", "ﬁ ligature Å Å",
]
_RNG = random.Random(0)
_ALPHABET = ([chr(c) for c in range(32, 127)] * 4 + [chr(c) for c in range(0xA0, 0x250)]
             + [chr(c) for c in range(0x3040, 0x30FF)] + ["😀", "🚀", "𐍈", " ", " ", "\n", "\t"])
RANDOM_TEXTS = ["".join(_RNG.choice(_ALPHABET) for _ in range(_RNG.randint(1, 60))) for _ in range(300)]


@pytest.fixture(scope="module")
def ckpt():
    return GGUFCheckpoint(FILE)


def _hf_tokenizer(folder, name):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


@pytest.fixture(scope="module")
def hf_tok():
    return _hf_tokenizer(DATA, NAME)


def _same_as_transformers(tok, hf, texts):
    for text in texts:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


def test_ids_and_text_equal_transformers(ckpt, hf_tok):
    _same_as_transformers(ckpt.tokenizer, hf_tok, TEXTS + RANDOM_TEXTS)


def test_ids_and_text_equal_sentencepiece(ckpt):
    """sentencepiece on the .model the vocabulary came from: the same ids, except where transformers (followed
    here) differs from it, on text that starts with a space (no extra dummy-prefix "▁"); control tokens in text
    are plain text to sentencepiece, so those texts are left out."""
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(DATA / "tiny-spm.model"))
    tok = ckpt.tokenizer
    texts = [t for t in TEXTS + RANDOM_TEXTS if "<" not in t]
    for text in texts:
        ids = sp.encode(text)
        assert tok.decode(ids) == sp.decode(ids), text
        if text[:1] not in (" ", "\u2581"):
            assert tok.encode(text, add_special_tokens=False) == ids, text
    # the one difference: sentencepiece prepends "▁" to " x" too, transformers does not
    assert sp.encode(" Hello", out_type=str)[0] == "\u2581\u2581"
    assert tok.backend.encode(" Hello").tokens[0] != "\u2581\u2581"


def test_vocabulary_and_special_tokens(ckpt):
    tok = ckpt.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 1024)
    assert tok.encode("Hello")[0] == 1 and tok.encode("Hello").count(1) == 1  # add_bos_token
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [3]  # a control token stays whole
    assert tok.encode("<tool>", add_special_tokens=False) == [5]  # and so does a user-defined one
    assert tok.decode([1, 3, 5, 2]) == "<tool>"  # control tokens are skipped, user-defined ones kept
    rocket = tok.encode("🚀", add_special_tokens=False)
    assert [tok.backend.id_to_token(i) for i in rocket] == ["\u2581", "<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]  # bytes
    assert tok.decode(tok.encode("🚀 ok")) == "🚀 ok"  # four byte pieces fused back into UTF-8


def test_chat_template_equals_transformers(ckpt, hf_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = ckpt.tokenizer.apply_chat_template(messages)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ckpt.tokenizer.encode_chat(messages) == hf_tok.encode(text, add_special_tokens=False)


def test_streamed_text_equals_decode(ckpt):
    tok = ckpt.tokenizer
    text = " ".join(TEXTS[:9]) * 4 + " end 🎉"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == detok.text == tok.decode(ids)
    assert "" in deltas and all("\ufffd" not in d for d in deltas)  # emoji bytes held back until complete
    # after a prompt, the "▁" of the first piece is a real space (the decoder drops only the text's first one)
    prompt = tok.encode("Prompt:")
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.add(i) for i in ids) + detok.flush()
    assert streamed == tok.decode(prompt + ids)[len(tok.decode(prompt)):] and streamed.startswith(" Hello")


def test_streamed_random_texts(ckpt):
    tok = ckpt.tokenizer
    for text in RANDOM_TEXTS[:100]:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [1])
        assert "".join(detok.add(i) for i in ids) + detok.flush() == tok.decode(ids), text


def test_merges_equal_transformers_generate_merges():
    """The merges from scores, ties included (many equal scores, pieces split several ways), on a random vocab."""
    pytest.importorskip("transformers")
    from transformers.tokenization_utils_base import generate_merges as reference

    from anygpu.models.tokenizer_spm import generate_merges

    rng = random.Random(1)
    vocab = {c: i for i, c in enumerate("abcde\u2581fg")}
    while len(vocab) < 3000:
        vocab.setdefault("".join(rng.choice("abcde\u2581fg") for _ in range(rng.randint(2, 10))), len(vocab))
    scores = {t: float(rng.randint(-40, 0)) for t in vocab}
    merges = generate_merges(vocab, scores)
    assert len(merges) > 2000 and merges == reference(vocab, scores)


# --- variants of the file's vocabulary metadata, against transformers ---

def _rewrite(tmp_path, name, **changes) -> str:
    """The test file with some tokenizer.ggml.* keys changed (None: removed); tensors dropped."""
    gguf = pytest.importorskip("gguf")
    meta = dict(read_gguf(FILE).metadata)
    for key, value in changes.items():
        meta[f"tokenizer.ggml.{key}"] = value
    w = gguf.GGUFWriter(str(tmp_path / name), "llama")
    for key, value in meta.items():
        if key in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count") or value is None:
            continue
        if key.endswith("token_type"):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return name


@pytest.mark.parametrize("changes", [
    {"token_type": [2] + read_gguf(FILE).metadata["tokenizer.ggml.token_type"][1:]},  # <unk> UNKNOWN (older files)
    {"add_bos_token": None},  # no flag: BOS is added (llama.cpp's default for SentencePiece)
    {"add_bos_token": False, "add_eos_token": True},
    {"unknown_token_id": None, "token_type": None},  # no types at all: every token normal
], ids=["unk-type-2", "no-bos-flag", "eos-not-bos", "no-types"])
def test_metadata_variants_equal_transformers(tmp_path, changes):
    name = _rewrite(tmp_path, "v.gguf", **changes)
    tok = Tokenizer.from_gguf(read_gguf(tmp_path / name).metadata)
    _same_as_transformers(tok, _hf_tokenizer(tmp_path, name), TEXTS + RANDOM_TEXTS[:50])


MISTRAL_V01_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")


def test_mistral_v01_chat_ids_equal_transformers(tmp_path):
    """A template that writes "<s>" itself and text right after it (no "▁" prepended there, as in transformers)."""
    name = _rewrite(tmp_path, "m.gguf")
    meta = {**read_gguf(tmp_path / name).metadata, "tokenizer.chat_template": MISTRAL_V01_TEMPLATE}
    tok = Tokenizer.from_gguf(meta)
    hf = _hf_tokenizer(tmp_path, name)
    hf.chat_template = MISTRAL_V01_TEMPLATE
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! 😀"},
                {"role": "user", "content": " two  spaces"}]
    ids = tok.encode_chat(messages)
    assert ids == list(hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1


@pytest.mark.parametrize("changes, pattern", [
    ({"tokenizer.ggml.scores": None}, r"tokenizer\.ggml\.scores: missing"),
    ({"tokenizer.ggml.scores": [0.0] * 1023}, r"tokenizer\.ggml\.scores: 1023 entries for 1024 tokens"),
    ({"tokenizer.ggml.scores": ["x"] * 1024}, r"tokenizer\.ggml\.scores: expected a list of one score"),
    ({"tokenizer.ggml.token_type": [1] * 1025}, r"tokenizer\.ggml\.token_type: 1025 entries for 1024 tokens"),
    ({"tokenizer.ggml.token_type": [1] * 7 + [9] + [1] * 1016}, r"tokenizer\.ggml\.token_type: token 7 \('<0x01>'\) "
                                                                r"has type 9; expected 1 \(normal\) to 6 \(byte\)"),
    ({"tokenizer.ggml.tokens": None}, r"tokenizer\.ggml\.tokens: missing"),
    ({"tokenizer.ggml.tokens": []}, r"tokenizer\.ggml\.tokens: empty"),
    ({"tokenizer.ggml.bos_token_id": 5000}, r"tokenizer\.ggml\.bos_token_id: 5000 is not a token id \(0 to 1023\)"),
    ({"tokenizer.ggml.model": "bert"}, r"'bert' is not supported; supported: 'gpt2' .*, 'llama' \(SentencePiece\)"),
])
def test_broken_vocabulary_errors_name_the_key(ckpt, changes, pattern):
    meta = {**ckpt.metadata, **changes}
    with pytest.raises(ValueError, match=pattern):
        Tokenizer.from_gguf({k: v for k, v in meta.items() if v is not None})


# --- the model: anygpu's engine against transformers' own loading of the same file ---

def test_logits_and_greedy_equal_transformers(ckpt, hf_tok):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from anygpu.engine import LLMEngine, SamplingParams
    from anygpu.models.registry import build_model

    from .test_models_llama import full_logits, hf_greedy

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DATA), gguf_file=NAME, dtype=torch.float32).eval()
    ids = ckpt.tokenizer.encode("The engine runs héllo 😀 files, 2024.")
    assert ids == hf_tok.encode("The engine runs héllo 😀 files, 2024.")
    got = full_logits(build_model(ckpt.config, ckpt.weights(progress=False)), ids)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(got, expected, atol=2e-5 * max(expected.abs().max().item(), 1.0), rtol=1e-4)
    engine = LLMEngine(str(FILE), progress=False, block_size=4, max_model_len=64)
    engine.add_request("r", ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    assert out.token_ids == hf_greedy(hf, ids, 12)


def test_cli_generate(hf_tok):
    transformers = pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    proc = subprocess.run([sys.executable, "-m", "anygpu.cli", "generate", "--model", str(FILE), "--raw",
                           "--max-tokens", "8", "Hello"], env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "prompt_tokens=4" in proc.stderr and "model=tiny-spm-llama.gguf" in proc.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DATA), gguf_file=NAME, dtype=torch.float32).eval()
    prompt = hf_tok.encode("Hello")
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    text, before = (hf_tok.decode(x, skip_special_tokens=True) for x in (out[0], prompt))
    assert proc.stdout.rstrip("\n") == text[len(before):]  # the text after "Hello", its first space kept


def _with_architecture(src: Path, dst: Path, arch: str) -> None:
    """A copy of the GGUF at ``src`` declaring ``arch`` (its ``<arch>.*`` keys renamed): the same vocabulary read
    by another family's tokenizer rules."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    old = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = arch + name[len(old):] if name.startswith(old + ".") else name
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_family_rules_equal_transformers(tmp_path, arch):
    """Gemma's SentencePiece files (spaces spelled as spaces, merges in file order, no prefix space) and Phi-3's
    (the prefix space from a normalizer) tokenize as transformers' GGUF loading builds them for that family."""
    _with_architecture(FILE, tmp_path / "t.gguf", arch)
    tok = Tokenizer.from_gguf(read_gguf(tmp_path / "t.gguf").metadata)
    _same_as_transformers(tok, _hf_tokenizer(tmp_path, "t.gguf"), TEXTS + RANDOM_TEXTS[:100])
