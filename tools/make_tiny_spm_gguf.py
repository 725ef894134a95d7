"""Write tests/data/tiny-spm.model and tests/data/tiny-spm-llama.gguf: a SentencePiece vocabulary and a tiny random
Llama carrying it the way llama.cpp's convert_hf_to_gguf.py writes Llama-2 / Mistral v0.1 files.

    .venv/bin/pip install sentencepiece gguf
    .venv/bin/python tools/make_tiny_spm_gguf.py [OUT_DIR]      # default tests/data

1. sentencepiece trains a BPE model (1000 pieces) with Llama-2's trainer settings (byte fallback, split digits,
   identity normalization, whitespace kept) on README.md and docs/guide/{install,engine,models}.md at commit
   caaae35 plus a few multilingual lines, with two control pieces (<|im_start|>, <|im_end|>) and one user-defined
   piece (<tool>).
2. The vocabulary is read back as convert_hf_to_gguf.py's ``_create_vocab_sentencepiece`` does: token types from
   IsUnknown / IsControl / IsUnused / IsByte, padded with [PADi] (UNUSED, score -1000) to the model's vocab_size
   (1024), tokenizer_config.json's added_tokens_decoder marking tokens CONTROL (special) or USER_DEFINED; then
   ``gguf.SpecialVocab`` reads the bos / eos / unk ids, add_bos_token / add_eos_token and the chat template from the
   folder's config.json and tokenizer_config.json, as the converter does.
3. The weights are random (numpy seed 0), F32: hidden 64, 4 heads, 2 kv heads, ffn 128, 2 layers.

Training is single-threaded and the corpus is pinned to a commit, so the output is the same on every run.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import sentencepiece as spm

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "caaae35"
SOURCES = ["README.md", "docs/guide/install.md", "docs/guide/engine.md", "docs/guide/models.md"]
EXTRA = ["Héllo wörld, ça va? Ñandú, naïve café.", "日本語のテキストです。中文文本。한국어 텍스트.",
         "Привет, мир! Γειά σου κόσμε.", "Numbers: 2024, 3.14159, 1,000,000.", "    indented code\n\tand tabs"]
PIECES, VOCAB = 1000, 1024
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 128, 2
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def corpus() -> list[str]:
    lines = []
    for name in SOURCES:
        text = subprocess.run(["git", "show", f"{COMMIT}:{name}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        lines += [line for line in text.splitlines() if line.strip()]
    return lines + EXTRA * 20


def train() -> bytes:
    """The serialized model (written to memory: a file's path would be recorded in it)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, model_type="bpe", vocab_size=PIECES,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, allow_whitespace_only_pieces=True, character_coverage=0.9995, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, control_symbols=["<|im_start|>", "<|im_end|>"], user_defined_symbols=["<tool>"],
        num_threads=1, minloglevel=2)
    return model.getvalue()


def vocab(sp: spm.SentencePieceProcessor, folder: Path):
    """tokens, scores, types as convert_hf_to_gguf.py's _create_vocab_sentencepiece builds them."""
    tokens = [f"[PAD{i}]".encode() for i in range(VOCAB)]
    scores, types = [-10000.0] * VOCAB, [5] * VOCAB
    for i in range(sp.vocab_size()):
        kind = 2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 5 if sp.IsUnused(i) else 6 if sp.IsByte(i) else 1
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode(), sp.GetScore(i), kind
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for i, data in config["added_tokens_decoder"].items():
        i, token = int(i), data["content"]
        types[i] = 3 if data.get("special") else 4
        scores[i], tokens[i] = -1000.0, (token if data.get("special") else token.replace("\u2581", " ")).encode()
    return tokens, scores, types


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = train()
        (out / "tiny-spm.model").write_bytes(model)
        sp = spm.SentencePieceProcessor(model_proto=model)
        added = {str(sp.PieceToId(t)): {"content": t, "special": s} for t, s in
                 [("<unk>", True), ("<s>", True), ("</s>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                  ("<tool>", False)]}
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "added_tokens_decoder": added, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
            "add_bos_token": True, "add_eos_token": False, "chat_template": CHATML}))
        (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0,
                                                         "vocab_size": VOCAB}))
        tokens, scores, types = vocab(sp, folder)

        w = gguf.GGUFWriter(str(out / "tiny-spm-llama.gguf"), "llama")
        w.add_name("tiny-spm-llama")
        w.add_block_count(LAYERS)
        w.add_context_length(512)
        w.add_embedding_length(HIDDEN)
        w.add_feed_forward_length(INTER)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_rope_dimension_count(HIDDEN // HEADS)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(VOCAB)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(w)

        rng = np.random.default_rng(0)
        kv = KV_HEADS * HIDDEN // HEADS
        shapes = {"token_embd.weight": (VOCAB, HIDDEN)}
        for i in range(LAYERS):
            shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
                           f"blk.{i}.attn_k.weight": (kv, HIDDEN), f"blk.{i}.attn_v.weight": (kv, HIDDEN),
                           f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                           f"blk.{i}.ffn_gate.weight": (INTER, HIDDEN), f"blk.{i}.ffn_up.weight": (INTER, HIDDEN),
                           f"blk.{i}.ffn_down.weight": (HIDDEN, INTER)})
        shapes.update({"output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)})
        for name, shape in shapes.items():
            if len(shape) == 1:
                w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            else:
                w.add_tensor(name, (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data")
