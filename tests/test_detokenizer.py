"""Streamed detokenization (issue 27): ``Tokenizer.window_decoder`` equals the tokenizers library's ``decode`` on
random id lists, and ``IncrementalDetokenizer`` streams the same deltas, step by step, as the two-decode
implementation it replaced (kept below as the spec), for every tokenizer kind the package builds: byte-level BPE
from a GGUF (the default model's) and from a tokenizer.json with added tokens, SentencePiece from a GGUF (Llama's
decoder, Gemma's and Phi-3's), the synthetic word-per-id tokenizer, and a decoder it does not redo and one with no
JSON form (the library then decodes)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from anygpu.models import GGUFCheckpoint, IncrementalDetokenizer, Tokenizer
from anygpu.models.gguf_file import read_gguf

from ._models_fixtures import smollm, smollm_path  # noqa: F401 - fixtures

SPM_FILE = Path(__file__).parent / "data" / "tiny-spm-llama.gguf"
TEXTS = ["Hello world", "  leading and   multiple spaces\n\n\ttabs\r\n", "héllo wörld ñ 日本語のテキスト 中文 한국어",
         "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷", "<|im_start|>user\nhi<|im_end|>\n", "it's 2024: 3,141,592", "x" * 40, "🚀 ok 𐍈"]


class SpecDetokenizer:
    """The IncrementalDetokenizer of commit debab8f, verbatim but for the names: two library decodes per token."""

    def __init__(self, tokenizer, prompt_ids, skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = [int(i) for i in prompt_ids[-5:]]
        self.prefix, self.read = 0, len(self.ids)
        self.text = ""

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id):
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        new_text = self._decode(self.ids[self.prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        if self.prefix > 64:
            del self.ids[:self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        self.text += delta
        return delta

    def flush(self):
        new_text = self._decode(self.ids[self.prefix:])
        delta = new_text[len(self._decode(self.ids[self.prefix:self.read])):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta


def _byte_level_folder(tmp_path) -> Tokenizer:
    """A tokenizer.json byte-level BPE with added tokens the byte alphabet does not spell (a space, "é", an
    emoji): special ones and plain ones, some also in the model's vocabulary."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for piece in ("Ġt", "he", "Ġthe", "Ã©", "ðŁ", "ĺĢ"):
        vocab[piece] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©"), ("ð", "Ł"), ("ĺ", "Ģ")]
    backend = Backend(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True),
                                AddedToken("<|tool call|>", special=True), AddedToken("he", special=True)])
    backend.add_tokens([AddedToken("<plain é>", special=False), AddedToken("😀", special=False),
                        AddedToken("Ġthe", special=False)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return Tokenizer.from_hf_folder(tmp_path)


def _metaspace(tmp_path) -> Tokenizer:
    """A decoder window_decoder does not redo (Metaspace, as newer Mistral tokenizer.json files have)."""
    spm = GGUFCheckpoint(SPM_FILE).tokenizer.backend
    spm.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    spm.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return Tokenizer.from_hf_folder(tmp_path)


def _custom_decoder() -> Tokenizer:
    """A Python decoder (no JSON form): the library decodes."""
    class Upper:
        def decode_chain(self, tokens):
            return [t.upper() for t in tokens]

    tok = Tokenizer.synthetic(300, 2)
    tok.backend.decoder = decoders.Decoder.custom(Upper())
    return tok


KINDS = {  # name: (how to build it, the window decoder's kind)
    "byte-level-gguf": (lambda request, tmp: request.getfixturevalue("smollm").tokenizer, "bytes"),
    "byte-level-folder": (lambda request, tmp: _byte_level_folder(tmp), "bytes"),
    "spm-llama": (lambda request, tmp: GGUFCheckpoint(SPM_FILE).tokenizer, "spm"),
    "spm-gemma": (lambda request, tmp: Tokenizer.from_gguf({**read_gguf(SPM_FILE).metadata,
                                                            "general.architecture": "gemma"}), "spm"),
    "spm-phi3": (lambda request, tmp: Tokenizer.from_gguf({**read_gguf(SPM_FILE).metadata,
                                                           "general.architecture": "phi3"}), "spm"),
    "synthetic": (lambda request, tmp: Tokenizer.synthetic(300, 2), "join"),
    "metaspace-folder": (lambda request, tmp: _metaspace(tmp), None),
    "custom-decoder": (lambda request, tmp: _custom_decoder(), None),
}


@pytest.fixture(params=sorted(KINDS))
def kind_tok(request, tmp_path):
    build, kind = KINDS[request.param]
    return request.param, kind, build(request, tmp_path)


def _hot_ids(tok: Tokenizer) -> list[int]:
    """Ids random lists should meet often: special and added tokens, byte pieces, the pieces of multi-byte text."""
    backend = tok.backend
    hot = list(backend.get_added_tokens_decoder())
    hot += [i for i in range(min(tok.vocab_size, 2000)) if (backend.id_to_token(i) or "").startswith("<0x")]
    for text in TEXTS:
        hot += tok.encode(text, add_special_tokens=False)
    return hot


def _random_ids(rng: random.Random, tok: Tokenizer, hot: list[int], n: int) -> list[int]:
    return [rng.choice(hot) if rng.random() < 0.7 else rng.randrange(tok.vocab_size) for _ in range(n)]


def test_window_decoder_equals_library(kind_tok):
    name, kind, tok = kind_tok
    rng = random.Random(0)
    hot = _hot_ids(tok)
    for skip in (True, False):
        window = tok.window_decoder(skip)
        assert window.kind == kind, name  # the repo's tokenizers decode in Python, the others in the library
        assert window is tok.window_decoder(skip)  # one per tokenizer and flag
        for _ in range(3000):
            ids = _random_ids(rng, tok, hot, rng.randint(0, 10))
            assert window.decode(ids) == tok.decode(ids, skip_special_tokens=skip), (name, skip, ids)


def _stream(detok, ids):
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_stream_equals_spec_on_random_ids(kind_tok):
    """Every delta and the flush equal the two-decode implementation's, on random ids after random prompts."""
    name, _, tok = kind_tok
    rng = random.Random(1)
    hot = _hot_ids(tok)
    for trial in range(300):
        skip = trial % 2 == 0
        prompt = _random_ids(rng, tok, hot, rng.randint(0, 8))
        ids = _random_ids(rng, tok, hot, rng.randint(1, 90))
        ours, spec = IncrementalDetokenizer(tok, prompt, skip), SpecDetokenizer(tok, prompt, skip)
        assert _stream(ours, ids) == _stream(spec, ids), (name, skip, prompt, ids)
        assert ours.text == spec.text and (ours.prefix, ours.read, ours.ids) == (spec.prefix, spec.read, spec.ids)


def test_stream_equals_full_decode_on_random_ids(kind_tok):
    """Without a prompt, the streamed text of random ids is their full decode, bytes that are not UTF-8 included.
    Not for SentencePiece (here as before: the spec streams the same): its ByteFallback turns a run of byte pieces
    that is not UTF-8 into one U+FFFD per byte, valid ones included, and the stream has emitted those before the
    bad byte came."""
    name, kind, tok = kind_tok
    if kind == "spm":
        m, bad = tok.backend.token_to_id("<0x6D>"), tok.backend.token_to_id("<0xD8>")
        for detok in (IncrementalDetokenizer(tok, []), SpecDetokenizer(tok, [])):
            assert _stream(detok, [m, bad]) == ["m", "", "\ufffd"]
        assert tok.decode([m, bad]) == "\ufffd\ufffd"
        return
    rng = random.Random(4)
    hot = _hot_ids(tok)
    for trial in range(300):
        skip = trial % 2 == 0
        ids = _random_ids(rng, tok, hot, rng.randint(1, 60))
        assert "".join(_stream(IncrementalDetokenizer(tok, [], skip), ids)) == tok.decode(ids, skip), (name, ids)


def test_stream_equals_full_decode(kind_tok):
    """Text that was encoded streams back to the full decode, split multi-byte characters and all; after a
    prompt, to the full decode's text beyond the prompt's."""
    name, _, tok = kind_tok
    rng = random.Random(2)
    alphabet = list("abc xyz\n\té日😀🇫") + [" the", "<s>", "<|im_end|>", "𐍈"]
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(200)]
    prompt = tok.encode("Prompt:")
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        for skip in (True, False):
            streamed = "".join(_stream(IncrementalDetokenizer(tok, [], skip), ids))
            assert streamed == tok.decode(ids, skip_special_tokens=skip), (name, text)
            if name not in ("synthetic", "metaspace-folder"):  # those join pieces by spaces / strip differently
                full = tok.decode(prompt + ids, skip_special_tokens=skip)
                after = "".join(_stream(IncrementalDetokenizer(tok, prompt, skip), ids))
                assert after == full[len(tok.decode(prompt, skip_special_tokens=skip)):], (name, text)


def test_ids_outside_the_vocabulary_go_to_the_library(smollm):
    """An id beyond the vocabulary (a model whose vocab_size is padded) is dropped, as the library drops it; a
    negative one raises as it did."""
    tok = smollm.tokenizer
    ids = tok.encode("ok 😀 fine", add_special_tokens=False)
    stream = ids[:3] + [tok.vocab_size + 7] + ids[3:]
    ours, spec = IncrementalDetokenizer(tok, [1]), SpecDetokenizer(tok, [1])
    assert _stream(ours, stream) == _stream(spec, stream)
    assert ours.text == tok.decode(ids)
    with pytest.raises(OverflowError):
        IncrementalDetokenizer(tok, []).add(-1)
    with pytest.raises(OverflowError):
        SpecDetokenizer(tok, []).add(-1)


def test_byte_fallback_reads_pieces_as_the_library_does(tmp_path):
    """ByteFallback takes "<0x" + two hex digits (either case, or "+" and one digit: Rust's from_str_radix) + ">"
    as a byte; other look-alikes are text.  A run of bytes that is not UTF-8 is one U+FFFD per byte."""
    pieces = ["<0xE2>", "<0x82>", "<0xAC>", "<0xe2>", "<0x+A>", "<0x0G>", "<0xE2>>", "<0x-1>", "▁a", "<unk>", "<s>"]
    vocab = {p: i for i, p in enumerate(pieces)}
    backend = Backend(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    backend.add_special_tokens([AddedToken("<s>", special=True)])
    tok = Tokenizer(backend, bos_token="<s>", eos_tokens=[], chat_template=None)
    rng = random.Random(3)
    for skip in (True, False):
        window = tok.window_decoder(skip)
        assert window.kind == "spm"
        for _ in range(3000):
            ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(0, 8))]
            assert window.decode(ids) == tok.decode(ids, skip_special_tokens=skip), ids
    assert tok.decode([0, 1, 2]) == "€" and tok.decode([3, 1, 2]) == "€" and tok.decode([4]) == "\n"
    assert tok.decode([0, 10, 1, 2]) == "€"  # a skipped special token does not split a run of bytes


def test_copies_and_pickles_make_their_own_tables():
    """A copied or unpickled tokenizer starts without the original's tables (their skip marks are identities)."""
    import copy
    import pickle

    tok = GGUFCheckpoint(SPM_FILE).tokenizer
    ids = [1, 3] + tok.encode("ok 🚀", add_special_tokens=False) + [2]
    assert tok.window_decoder(True).decode(ids) == tok.decode(ids)  # tables filled, special tokens included
    for other in (copy.deepcopy(tok), pickle.loads(pickle.dumps(tok))):
        assert other.window_decoder(True) is not tok.window_decoder(True)
        assert other.window_decoder(True).decode(ids) == tok.decode(ids)
        assert "".join(_stream(IncrementalDetokenizer(other, [1]), ids)) == tok.decode(ids)
