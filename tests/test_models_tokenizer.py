"""anygpu.models.tokenizer: ids, decoding and chat templates equal to transformers' (the oracle, read from the same
GGUF), tokenizer.json folders, and streamed detokenization."""

import json

import jinja2
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from anygpu.models import IncrementalDetokenizer, Tokenizer

from ._models_fixtures import hf_tokenizer, smollm, smollm_path  # noqa: F401 - fixtures

TEXTS = [
    "Hello world",
    "  leading and   multiple spaces\n\n\ttabs\r\n",
    "2024 digits 12345.678 and 3,141,592",
    "héllo wörld ñ 日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> <jupyter_code>",
    "it's don't I'll WE'VE",
    "x" * 300,
    "",
]
# docs/design/engine-plan.md §3: "What is the capital of France?" through SmolLM2's template, as transformers encodes it.
CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
            2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
MULTI_TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "Bye"}]


@pytest.mark.parametrize("special", [True, False])
def test_gguf_ids_and_text_equal_transformers(smollm, hf_tokenizer, special):
    tok = smollm.tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_gguf_special_tokens(smollm):
    tok = smollm.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 49152)
    assert tok.encode("<|im_start|>") == [1]  # a control token stays whole
    assert tok.decode([1, 504, 2]) == "The"  # and is skipped by default


def test_chat_prompt_ids(smollm, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert smollm.tokenizer.encode_chat(messages) == CHAT_IDS
    assert list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]) == CHAT_IDS


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_equals_transformers(smollm, hf_tokenizer, generation_prompt):
    for messages in (MULTI_TURN, MULTI_TURN[1:]):  # with a system prompt, and the template's default one
        ours = smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=generation_prompt)
    assert "named SmolLM" in smollm.tokenizer.apply_chat_template(MULTI_TURN[1:])


def test_saved_hf_folder_matches(tmp_path, smollm, hf_tokenizer):
    """transformers' save_pretrained writes tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    hf_tokenizer.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.chat_template) == (1, (2,), smollm.tokenizer.chat_template)
    for text in TEXTS:
        assert tok.encode(text) == smollm.tokenizer.encode(text)
    assert tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]) == CHAT_IDS


def _byte_level_folder(path, *, post_bos: bool, config: dict):
    """A tiny tokenizer.json: the 256 byte tokens, <s> and </s>; optionally a post-processor that adds <s>."""
    backend = Backend(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    if post_bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    path.mkdir(exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>",
                                                            **config}))
    return Tokenizer.from_hf_folder(path)


@pytest.mark.parametrize("post_bos", [True, False])
def test_bos_added_once(tmp_path, post_bos):
    tok = _byte_level_folder(tmp_path, post_bos=post_bos, config={"add_bos_token": True})
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (256, (257,), 258)
    ids = tok.encode("hi")
    assert ids[0] == 256 and ids.count(256) == 1
    assert tok.encode("hi", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "hi"


def test_folder_templates(tmp_path):
    template = ("{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                "{{ bos_token }}{{ m.content | tojson }}{% generation %}!{% endgeneration %}{% endfor %}")
    tok = _byte_level_folder(tmp_path, post_bos=False, config={"chat_template": [{"name": "default",
                                                                                 "template": template}]})
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>"é"!'
    with pytest.raises(jinja2.TemplateError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")  # takes precedence over tokenizer_config
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([]) == "</s>"


def test_errors(tmp_path, smollm):
    tok = _byte_level_folder(tmp_path / "t", post_bos=False, config={})
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    with pytest.raises(ValueError, match="'bert'.*not supported"):
        Tokenizer.from_gguf({**smollm.metadata, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.scores: missing"):  # "llama" (SentencePiece) has scores
        Tokenizer.from_gguf({**smollm.metadata, "tokenizer.ggml.model": "llama"})


def test_gguf_pre_tokenizer_splits_are_transformers(smollm):
    """Every "tokenizer.ggml.pre" name we know splits as transformers' GGUF table says (its regexes are the
    oracle), and the name changes how text is cut before the merges: GPT-4o's keeps a contraction on its word
    and groups digits by three, Tekken's cuts digits one by one, Llama 3's cuts the contraction off."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from anygpu.models import tokenizer as T

    for name, split in T._GGUF_SPLITS.items():
        assert split == GGUF_PRE_TOKENIZER_SPLITS[name], name
    assert {"gpt-4o", "llama4", "tekken", "llama-bpe", "qwen2"} <= set(T._GGUF_SPLITS)

    def pieces(pre):
        backend = Tokenizer.from_gguf({**smollm.metadata, "tokenizer.ggml.pre": pre}).backend
        return [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("WE'VE don't 12345")]

    assert pieces("gpt-4o") == ["WE'VE", "Ġdon't", "Ġ", "123", "45"]
    assert pieces("tekken") == ["WE", "'VE", "Ġdon", "'t", "Ġ", "1", "2", "3", "4", "5"]
    assert pieces("llama-bpe") == ["WE", "'VE", "Ġdon", "'t", "Ġ", "123", "45"]


def _stream(tok, ids, prompt=()):
    detok = IncrementalDetokenizer(tok, list(prompt))
    deltas = [detok.add(i) for i in ids]
    return detok, deltas


def test_incremental_detokenizer(smollm):
    tok = smollm.tokenizer
    text = " ".join(TEXTS[:7]) * 8 + " end 🎉"
    ids = tok.encode(text, add_special_tokens=False)
    detok, deltas = _stream(tok, ids, prompt=CHAT_IDS)
    assert "".join(deltas) == detok.text == tok.decode(ids)
    assert "" in deltas  # some emoji bytes were held back until their character was complete
    assert all("\ufffd" not in d for d in deltas)
    assert len(detok.ids) < 80  # a bounded window, not the whole history: O(1) per token
    # special tokens: skipped by default, kept when asked
    assert "".join(_stream(tok, [504, 2, 504])[1]) == tok.decode([504, 2, 504])
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(detok.add(i) for i in [504, 2, 504]) == "The<|im_end|>The"


def test_incremental_flush(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)
    detok, deltas = _stream(tok, ids[:-1])  # the emoji's last byte never comes
    assert "".join(deltas) == "ok"
    assert detok.flush().endswith("\ufffd") and detok.text.startswith("ok ")
