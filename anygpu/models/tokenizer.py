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


class IncrementalDetokenizer:
    """The text of generated tokens, one token at a time, in O(1) per token.

    Each step decodes a short window: the tokens since ``prefix`` (already-emitted context, so sentencepiece's
    leading-space rule and byte merges see their neighbours) and ``read`` (where unemitted tokens start).  The
    new text is what the window decodes to beyond the prefix.  A window ending in U+FFFD is an incomplete UTF-8
    sequence (an emoji split over byte-level tokens): nothing is emitted until its last byte arrives.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = [int(i) for i in prompt_ids[-5:]]  # left context for the first token (vLLM's choice of 5)
        self.prefix, self.read = 0, len(self.ids)
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        new_text = self._decode(self.ids[self.prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
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
        self.text += delta
        return delta
