"""``Tokenizer`` (text <-> ids, chat template) and ``IncrementalDetokenizer`` (streamed text, token by token).

    tok = Tokenizer.from_hf_folder("path/to/model")           # tokenizer.json + tokenizer_config.json
    tok = Tokenizer.from_gguf(metadata)                        # a GGUF's vocabulary: byte-level BPE ("gpt2") or
                                                               # SentencePiece ("llama": Llama-2, Mistral v0.1)
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])

Built on the ``tokenizers`` library (no transformers at run time).  A GGUF carries no tokenizer.json, so the
BPE is rebuilt from its tokens and merges the way transformers does it (same ids, checked in the tests); a
SentencePiece vocabulary (no merges, one score per piece) is rebuilt in tokenizer_spm.py, also as transformers does.
Chat templates are untrusted code from the Hub: they run in jinja2's immutable sandbox, with the helpers
transformers gives them (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from .folder_files import MAX_JSON_BYTES, MAX_TOKENIZER_BYTES, check_size, read_json
from .tokenizer_spm import spm_backend

# llama.cpp's "tokenizer.ggml.pre" names the regex that splits text before BPE; these are the splits of the
# families this package runs (from transformers' GGUF table).  Unknown names get GPT-2's, as in transformers.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (o200k) split: Phi-4-mini, Llama 4; Mistral's Tekken (Mistral Nemo): the same without contractions,
# digits one at a time.
_WORD = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}" \
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O_SPLIT = _WORD.replace("{c}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?") + r"|\p{N}{1,3}" + _REST
_TEKKEN_SPLIT = _WORD.replace("{c}", "") + r"|\p{N}" + _REST
_GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
                "gpt-4o": _GPT4O_SPLIT, "llama4": _GPT4O_SPLIT, "tekken": _TEKKEN_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _byte_level_backend(metadata: dict) -> _Backend:
    """Byte-level BPE from a "gpt2" GGUF vocabulary: tokens, merges and the pre-tokenizer's split."""
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata.get("tokenizer.ggml.token_type") or []
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet (raw UTF-8) is respelled so BPE can produce it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    backend = _Backend(models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                  fuse_unk=False))
    split = _GGUF_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # A "control" token outside the byte alphabet is a llama.cpp mislabel (transformers skips those too).
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab])
    return backend


class Tokenizer:
    def __init__(self, backend: _Backend, *, bos_token: str | None, eos_tokens: list[str], chat_template: str | None,
                 add_bos_token: bool = False, add_eos_token: bool = False):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids = tuple(i for i in (backend.token_to_id(t) for t in eos_tokens) if i is not None)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        # A tokenizer.json's post-processor may add BOS itself (Llama 3); add it by hand only when it does not.
        post = backend.post_processor
        adds = post is not None and post.num_special_tokens_to_add(False) > 0
        self._prepend = [self.bos_token_id] if add_bos_token and not adds and self.bos_token_id is not None else []
        self._append = [self.eos_token_ids[0]] if add_eos_token and not adds and self.eos_token_ids else []
        self._windows: dict[bool, WindowDecoder] = {}  # window_decoder's, one per skip_special_tokens

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            sentencepiece = (path / "tokenizer.model").exists()
            hint = " (a sentencepiece tokenizer.model alone is not supported)" if sentencepiece else ""
            raise FileNotFoundError(f"{path}: no tokenizer.json{hint}")
        tokenizer_json = path / "tokenizer.json"
        check_size(tokenizer_json, MAX_TOKENIZER_BYTES)
        try:
            backend = _Backend.from_file(str(tokenizer_json))
        except Exception as e:  # the tokenizers library raises plain Exceptions for bad JSON and bad models
            raise ValueError(f"{tokenizer_json}: not a readable tokenizer.json ({e})") from None
        config_path = path / "tokenizer_config.json"
        cfg = _read_json(config_path) or {}
        eos = _token_content(cfg.get("eos_token"), "eos_token", config_path)
        return cls(backend, bos_token=_token_content(cfg.get("bos_token"), "bos_token", config_path),
                   eos_tokens=[eos] if eos else [], chat_template=_folder_chat_template(path, cfg),
                   add_bos_token=bool(cfg.get("add_bos_token", False)),
                   add_eos_token=bool(cfg.get("add_eos_token", False)))

    @classmethod
    def from_gguf(cls, metadata: dict) -> Tokenizer:
        """The vocabulary of a GGUF's ``tokenizer.ggml.*`` keys, as transformers reads it: byte-level BPE ("gpt2")
        or SentencePiece ("llama").  Control tokens (type 3) become special added tokens (kept whole and skipped by
        decode), user-defined ones (type 4) plain added tokens."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend = _byte_level_backend(metadata)
            add_bos = metadata.get("tokenizer.ggml.add_bos_token", False)
        elif kind == "llama":
            backend = spm_backend(metadata)
            # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise (so does transformers)
            add_bos = metadata.get("tokenizer.ggml.add_bos_token", True)
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                             "'llama' (SentencePiece)")
        tokens = metadata["tokenizer.ggml.tokens"]

        def token(key):
            i = metadata.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        eos = [t for t in (token("eos"), token("eot"), token("eom")) if t is not None]
        return cls(backend, bos_token=token("bos"), eos_tokens=list(dict.fromkeys(eos)),
                   chat_template=metadata.get("tokenizer.chat_template"), add_bos_token=bool(add_bos),
                   add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)))

    @classmethod
    def synthetic(cls, vocab_size: int, eos_token_id: int | None = None) -> Tokenizer:
        """A word-per-id tokenizer ("w0" ... "w{vocab_size-1}", space-separated) for models with random weights:
        benchmarks then stream and detokenize real text, as they would with a checkpoint's tokenizer."""
        words = {f"w{i}": i for i in range(vocab_size)}
        backend = _Backend(models.WordLevel(words, unk_token="w0"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        eos = [f"w{eos_token_id}"] if eos_token_id is not None else []
        return cls(backend, bos_token=None, eos_tokens=eos, chat_template=None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._prepend + ids + self._append if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __getstate__(self) -> dict:  # a copy or a pickle makes its own window decoders (their tables hold sentinels)
        return {**self.__dict__, "_windows": {}}

    def window_decoder(self, skip_special_tokens: bool = True) -> WindowDecoder:
        """``decode`` for the short windows of ``IncrementalDetokenizer``, one per ``skip_special_tokens``, made on
        first use (see ``WindowDecoder``)."""
        window = self._windows.get(skip_special_tokens)
        if window is None:
            window = self._windows[skip_special_tokens] = WindowDecoder(self, skip_special_tokens)
        return window

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass a plain prompt instead of messages")
        return _compile(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The template writes BOS and the role markers itself: encode its text without adding specials."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _read_json(path: Path):
    return read_json(path) if path.is_file() else None


def _token_content(token, key: str, where: Path) -> str | None:
    """tokenizer_config.json writes a token as a string or as an AddedToken dict {"content": ...}."""
    content = token.get("content") if isinstance(token, dict) else token
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{where}: {key}: expected a string or {{\"content\": string}}, got {token!r:.100}")
    return content


def _folder_chat_template(path: Path, cfg: dict) -> str | None:
    """chat_template.jinja (transformers >= 4.50 saves it there), chat_template.json, then tokenizer_config.json."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        check_size(jinja, MAX_JSON_BYTES)
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja}: not UTF-8 text ({e})") from None
    where = path / "chat_template.json"
    template = (_read_json(where) or {}).get("chat_template")
    if not template:
        where, template = path / "tokenizer_config.json", cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            raise ValueError(f"{where}: chat_template: expected a string or a list of {{\"name\", \"template\"}} "
                             "objects")
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{where}: chat_template: expected a string, got {type(template).__name__}")
    return template


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): render the body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


_CHAR_BYTES = {c: b for b, c in _byte_alphabet().items()}
# str.translate table: the byte alphabet's characters to the Latin-1 characters of their bytes, and the
# characters below 256 outside it to one Latin-1 cannot encode (so the token falls back to its UTF-8).
_TO_LATIN1 = {**{c: "\uffff" for c in range(256)}, **{ord(c): chr(b) for c, b in _CHAR_BYTES.items()}}
# The tokenizers library's ByteFallback reads a piece of 6 bytes "<0x" + 2 + ">" as a byte when Rust's
# u8::from_str_radix(_, 16) takes the middle two (which allows a leading "+").
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2}|\+[0-9A-Fa-f])>")
_SKIP = object()  # a piece decode leaves out: a skipped special token, or an id the vocabulary does not name
_SPM_DECODER = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
_SPM_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


class WindowDecoder:
    """``decode(ids)``, equal to ``Tokenizer.decode(ids, skip_special_tokens)`` for every list of ids in
    ``[0, limit)``, and the split of a window's text that ``IncrementalDetokenizer`` streams from: every running
    sequence calls it every step.

    The decoders this package builds are redone here on per-token pieces, each looked up once in the library and
    kept (a table the size of the vocabulary, filled as ids come): byte-level BPE (``kind`` "bytes": GPT-2's
    ``ByteLevel``, every piece's bytes joined and read as UTF-8, U+FFFD for bad bytes), SentencePiece ("spm":
    tokenizer_spm.py's ``Replace("\u2581", " ")``, ``ByteFallback``, ``Fuse`` and, but for Gemma, ``Strip`` of one
    leading space; Llama-2's and Mistral's tokenizer.json have the same) and none ("join": pieces joined by
    spaces, ``Tokenizer.synthetic``).  Any other decoder (``kind`` None) calls the library, and ``limit`` 0
    sends every id there.  Special tokens are skipped by their text, as the library does.

    ``prefix(ids)`` and ``tail(ids, state)`` split a window prefix + tail without decoding it whole.  A prefix is
    *clean* when its text cannot change whatever follows it: its bytes end on a whole character other than
    U+FFFD (bytes), its last piece is not a byte piece (spm), always (join).  Then decode(prefix + tail) is the
    prefix's text plus ``tail``'s ``extra``, worked out from the tail alone (and ``state``, what the prefix
    leaves for the tail: whether it had any piece (join), whether its text before the strip was empty (spm)).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        backend = tokenizer.backend
        self.backend, self.skip = backend, skip_special_tokens
        added = backend.get_added_tokens_decoder()
        self._special = {t.content for t in added.values() if t.special} if skip_special_tokens else set()
        decoder = backend.decoder
        try:
            state = json.loads(decoder.__getstate__()) if decoder is not None else None
        except Exception:  # a decoder with no JSON form (a custom Python one): the library decodes
            state = {}
        kind, self._strip = None, False
        if state is None:
            kind = "join"
        elif state.get("type") == "ByteLevel":
            kind = "bytes"
        elif state.get("type") == "Sequence" and state.get("decoders") in (_SPM_DECODER, _SPM_DECODER + [_SPM_STRIP]):
            kind = "spm"
            self._strip = len(state["decoders"]) == 4
        self.kind = kind
        size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        self.limit = size if kind is not None else 0
        self._pieces: list = [None] * self.limit
        # A prefix left by a token emitted on its own is clean with this state: bytes None, the others True
        # (it had a piece / text).  single(i): that token's step after such a prefix, kept per token.
        self.steady = None if kind == "bytes" else True
        self._single: list = [None] * self.limit
        self._texts: list = [None] * size  # token_text(i), the library's for decoders not redone here
        self.decode, self.prefix, self.tail = {
            "bytes": (self._decode_bytes, self._prefix_bytes, self._tail_bytes),
            "spm": (self._decode_spm, self._prefix_spm, self._tail_spm),
            "join": (self._decode_join, self._prefix_join, self._tail_join),
            None: (self._decode_library, self._prefix_library, None)}[kind]

    def _piece(self, i: int):
        """Token i as this decoder's piece: bytes (bytes), str or a byte value (spm), str (join); _SKIP
        (b"" for bytes) where decode leaves it out."""
        token = self.backend.id_to_token(i)
        if token is None or token in self._special:
            return b"" if self.kind == "bytes" else _SKIP
        if self.kind == "bytes":  # the library's ByteLevel: a piece outside the byte alphabet is its own UTF-8
            try:
                return token.translate(_TO_LATIN1).encode("latin-1")
            except UnicodeEncodeError:
                return token.encode()
        if self.kind == "spm":
            token = token.replace("\u2581", " ")
            byte = _BYTE_PIECE.fullmatch(token)
            return int(byte.group(1), 16) if byte else token
        return token

    def single(self, i: int):
        """Token i's step after a steady prefix (see above): (delta, the token's own text) when it emits and leaves
        a steady prefix behind, else False (the caller takes the general path)."""
        step = self._single[i]
        if step is None:
            delta, text, clean, state = self.tail([i], self.steady)
            ok = delta != "" and delta[-1] != "\ufffd" and clean and state == self.steady
            step = self._single[i] = (delta, text) if ok else False
        return step

    def token_text(self, i: int) -> str:
        """``decode([i])``, kept per token id (a log-probability's token text, ``LLMEngine._entry``).  An id
        outside the vocabulary goes to the library each time, as ``Tokenizer.decode`` sends it."""
        if 0 <= i < len(self._texts):
            text = self._texts[i]
            if text is None:
                text = self._texts[i] = self.decode([i])
            return text
        return self.backend.decode([i], skip_special_tokens=self.skip)

    def _lookup(self, ids: list[int]) -> list:
        """The pieces of ids, skipped ones left out (but for bytes, where they are b"")."""
        pieces = self._pieces
        got = [pieces[i] for i in ids]
        if None in got:
            for i in ids:
                if pieces[i] is None:
                    pieces[i] = self._piece(i)
            got = [pieces[i] for i in ids]
        return got if _SKIP not in got else [p for p in got if p is not _SKIP]

    # -- the library (other decoders) ----------------------------------------------------------------------
    def _decode_library(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip)

    def _prefix_library(self, ids: list[int]):
        return self._decode_library(ids), False, None

    # -- byte-level BPE --------------------------------------------------------------------------------------
    def _decode_bytes(self, ids: list[int]) -> str:
        return b"".join(self._lookup(ids)).decode("utf-8", "replace")

    def _prefix_bytes(self, ids: list[int]):
        text = self._decode_bytes(ids)
        return text, text[-1:] != "\ufffd", None

    def _tail_bytes(self, ids: list[int], state):
        """(extra, the tail's own text, whether it is clean, its state) after a clean prefix: bytes after a
        whole character are read from scratch."""
        text = self._decode_bytes(ids)
        return text, text, text[-1:] != "\ufffd", None

    # -- no decoder: pieces joined by spaces ----------------------------------------------------------------
    def _decode_join(self, ids: list[int]) -> str:
        return " ".join(self._lookup(ids))

    def _prefix_join(self, ids: list[int]):
        got = self._lookup(ids)
        return " ".join(got), True, bool(got)

    def _tail_join(self, ids: list[int], state):
        got = self._lookup(ids)
        text = " ".join(got)
        return (" " + text if state and got else text), text, True, bool(got)

    # -- SentencePiece ---------------------------------------------------------------------------------------
    def _fused(self, ids: list[int]) -> tuple[str, list]:
        """The window's text before the strip, and its pieces."""
        got = self._lookup(ids)
        try:
            return "".join(got), got  # no byte piece: the usual window
        except TypeError:
            return "".join(_fuse_byte_pieces(got)), got

    def _stripped(self, text: str) -> str:
        return text[1:] if self._strip and text[:1] == " " else text

    def _decode_spm(self, ids: list[int]) -> str:
        return self._stripped(self._fused(ids)[0])

    def _prefix_spm(self, ids: list[int]):
        text, got = self._fused(ids)
        return self._stripped(text), not got or not isinstance(got[-1], int), text != ""

    def _tail_spm(self, ids: list[int], state):
        """After a clean prefix no run of byte pieces spans the two, and the strip touches the prefix's text
        unless that was empty."""
        text, got = self._fused(ids)
        own = self._stripped(text)
        return (text if state else own), own, not got or not isinstance(got[-1], int), text != ""


def _fuse_byte_pieces(pieces: list) -> list[str]:
    """The library's ByteFallback: each run of byte pieces is its UTF-8 text, or one U+FFFD per byte when the run
    is not valid UTF-8."""
    out, run = [], []
    for p in pieces:
        if isinstance(p, int):
            run.append(p)
            continue
        if run:
            out.append(_byte_run(run))
            run = []
        out.append(p)
    if run:
        out.append(_byte_run(run))
    return out


def _byte_run(run: list[int]) -> str:
    try:
        return bytes(run).decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


class IncrementalDetokenizer:
    """The text of generated tokens, one token at a time, in O(1) per token.

    Each step decodes a short window: the tokens since ``prefix`` (already-emitted context, so sentencepiece's
    leading-space rule and byte merges see their neighbours) and ``read`` (where unemitted tokens start).  The
    new text is what the window decodes to beyond the prefix.  A window ending in U+FFFD is an incomplete UTF-8
    sequence (an emoji split over byte-level tokens): nothing is emitted until its last byte arrives.

    Host time (every running sequence pays this every step): the prefix's text is kept until the prefix moves,
    and when the prefix is clean (``WindowDecoder``: nothing after it can change its text, the usual case) a
    step decodes only the tokens since ``read``, usually the new one, from pieces cached per token; the text is
    the one decoding the whole window gives.  After a token that emitted on its own, the next one's delta is
    looked up (``WindowDecoder.single``, kept per token id): most tokens cost a table lookup.  Otherwise (an unclean prefix, a decoder ``WindowDecoder`` does not
    redo) the window is decoded whole.  An id the piece table does not hold (outside the vocabulary, negative)
    sends the stream to the library's decode, which drops or rejects it as before.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        window = tokenizer.window_decoder(skip_special_tokens)
        self._decode, self._split, self._tail, self._limit = window.decode, window.prefix, window.tail, window.limit
        self._window, self._singles = window, window._single
        self.ids = [int(i) for i in prompt_ids[-5:]]  # left context for the first token (vLLM's choice of 5)
        if not all(0 <= i < self._limit for i in self.ids):
            self._use_library()
        self.prefix, self.read = 0, len(self.ids)
        # The prefix ids[prefix:read]: its text (None: not decoded yet), whether it is clean, its state for tail.
        self._prefix_text: str | None = None
        self._clean, self._state = False, None
        self._steady = False  # clean, in the window's steady state, and nothing unemitted: add's shortest path
        self.text = ""

    def _use_library(self) -> None:
        self._limit = 1 << 62  # every id from now on: the library decides (drops unknown ids, rejects negative ones)
        self._decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        self._split = lambda ids: (self._decode(ids), False, None)
        self._clean = self._steady = False

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        ids = self.ids
        if self._steady and 0 <= token_id < self._limit:  # the usual token: one that emits on its own
            step = self._singles[token_id]
            if step is None:
                step = self._window.single(token_id)
            if step:  # _emit, inline: this is most tokens of most sequences
                delta, self._prefix_text = step
                ids.append(token_id)
                self.prefix, self.read = self.read, len(ids)
                if self.prefix > 64:
                    del ids[:self.prefix]
                    self.read -= self.prefix
                    self.prefix = 0
                self.text += delta
                return delta
        if not 0 <= token_id < self._limit:
            self._use_library()
        ids.append(token_id)
        self._steady = False
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text, self._clean, self._state = self._split(ids[self.prefix:self.read])
            self._prefix_text = prefix_text
        if self._clean:  # decode(window) == prefix_text + delta
            delta, tail_text, clean, state = self._tail(ids[self.read:], self._state)
            if not delta or delta[-1] == "\ufffd":
                return ""
            self._prefix_text, self._clean, self._state = tail_text, clean, state  # the tail is the next prefix
            self._steady = clean and state == self._window.steady
        else:
            new_text = self._decode(ids[self.prefix:])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                return ""
            delta = new_text[len(prefix_text):]
            self._prefix_text = None
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        """The unemitted tokens become the prefix."""
        self.prefix, self.read = self.read, len(self.ids)
        if self.prefix > 64:  # forget tokens before the window so the list stays short
            del self.ids[:self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is held back at the end of generation (a truncated UTF-8 sequence decodes to U+FFFD)."""
        new_text = self._decode(self.ids[self.prefix:])
        delta = new_text[len(self._decode(self.ids[self.prefix:self.read])):]
        self.prefix, self.read = self.read, len(self.ids)
        self._prefix_text, self._steady = None, False
        self.text += delta
        return delta
