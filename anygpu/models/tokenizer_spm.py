"""A GGUF's SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Llama-2, Mistral v0.1, TinyLlama,
CodeLlama, Gemma, Phi-3...) as a ``tokenizers`` backend.

    backend = spm_backend(metadata)       # used by Tokenizer.from_gguf

Such a file has pieces ("▁" for a space, ``<0x0A>`` byte-fallback pieces), one float score per piece, token
types, and no merges.  The backend is the one transformers builds from the same file (its GGUF loading is the
oracle, and the tests hold us to its ids and text): a BPE with byte fallback whose merges are every split of every
piece into two pieces, ranked by the merged piece's score (transformers' ``generate_merges``, including its
tie-breaks); a ``Metaspace`` pre-tokenizer that turns spaces into "▁" and prepends one to the text unless it
already starts with a space; and a decoder that turns "▁" back into spaces, fuses byte pieces into UTF-8 and drops
the prepended space.  Control tokens (type 3), the unknown / bos / eos / padding tokens (and "<unk>", "<s>",
"</s>" by name, as transformers' LlamaTokenizer has them) are special added tokens; user-defined ones (type 4)
plain added tokens.

Why BPE from scores and not ``Unigram``: SentencePiece BPE models (all of these families) encode by repeatedly
merging the adjacent pair whose merged piece scores highest; merges ranked by that score do the same.  Unigram
would pick the best-scoring segmentation instead, which differs on many words.

Two families differ, as transformers builds them from their files: Gemma stores a token of spaces as spaces (its
tokenizer looks "▁▁" up), ranks merges by the tokens' order in the file (its scores do not follow the merge
order), turns spaces into "▁" with a normalizer and prepends none; Phi-3 prepends its "▁" with a normalizer, so
leading spaces all stay.

Known difference from sentencepiece (and llama.cpp) that transformers has too: text that starts with a space gets
no extra "▁" (sentencepiece's dummy prefix would make "  x" three "▁"s, here two).  Elsewhere the ids equal
sentencepiece's on the tests' texts.
"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _list(metadata: dict, key: str, kind: type | tuple[type, ...], what: str, n: int | None) -> list:
    value = metadata.get(key)
    if value is None:
        raise ValueError(f"{key}: missing; a SentencePiece ('llama') vocabulary needs {what}")
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{key}: expected a list of {what}, got {type(value).__name__}")
    if n is not None and len(value) != n:
        raise ValueError(f"{key}: {len(value)} entries for {n} tokens (tokenizer.ggml.tokens); expected one per token")
    return value


def spm_vocab(metadata: dict) -> tuple[list[str], list[float], list[int]]:
    """tokens, scores and types, checked: errors name the key."""
    tokens = _list(metadata, "tokenizer.ggml.tokens", str, "the tokens (strings)", None)
    if not tokens:
        raise ValueError("tokenizer.ggml.tokens: empty")
    scores = _list(metadata, "tokenizer.ggml.scores", (int, float), "one score (a number) per token", len(tokens))
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        types = [NORMAL] * len(tokens)
    else:
        types = _list(metadata, "tokenizer.ggml.token_type", int, "one token type (an integer) per token",
                      len(tokens))
        bad = next((i for i, t in enumerate(types) if not NORMAL <= t <= BYTE), None)
        if bad is not None:
            raise ValueError(f"tokenizer.ggml.token_type: token {bad} ({tokens[bad]!r:.40}) has type {types[bad]}; "
                             f"expected 1 (normal) to 6 (byte)")
    for key in ("bos", "eos", "unknown", "padding"):
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and (not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tokens)):
            raise ValueError(f"tokenizer.ggml.{key}_token_id: {i!r} is not a token id (0 to {len(tokens) - 1})")
    return tokens, [float(s) for s in scores], types


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """transformers' ``generate_merges`` with scores: every (left, right) split of a piece into two pieces, best
    merged-piece score first; ties go to the longer left piece, then the longer right piece, then vocab order."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


_GEMMA = ("gemma", "gemma2", "gemma3")


def spm_backend(metadata: dict) -> _Backend:
    tokens, scores, types = spm_vocab(metadata)
    arch = metadata.get("general.architecture")
    if arch in _GEMMA:
        # Gemma files store a token of spaces as spaces (its tokenizer looks "▁▁" up), and their merge order is
        # the order of the tokens in the file, not their scores; no space is prepended, none stripped.
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        ranks = {t: -i for i, t in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, scores))
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = _Backend(models.BPE(vocab, generate_merges(vocab, ranks), dropout=None, fuse_unk=True,
                                  byte_fallback=True))
    bytes_back = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch in _GEMMA:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(bytes_back)
    else:
        if arch == "phi3":  # the prefix space comes from a normalizer: "  hi" keeps all its spaces ("▁▁▁hi")
            backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                       normalizers.Replace(" ", "\u2581")])
        else:
            backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence(bytes_back + [decoders.Strip(content=" ", left=1, right=0)])
    # Special, as in transformers: the control tokens, the file's bos / eos / unknown / padding tokens, and the
    # names LlamaTokenizer gives them by default (when the vocabulary has them: transformers would append them).
    named = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("unknown", "bos", "eos", "padding")]
    special = [tokens[i] for i, t in enumerate(types) if t == CONTROL] + [tokens[i] for i in named if i is not None]
    special = list(dict.fromkeys(special + [t for t in ("<unk>", "<s>", "</s>") if t in vocab]))
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
    return backend
