"""The engine's commands, run as a user runs them: `anygpu generate` (the README's main command), `anygpu chat`
and `anygpu bench model`, in a real subprocess of the installed entry point's module."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from ._models_fixtures import smollm_path  # noqa: F401 - fixture


def anygpu(*args, stdin: str | None = None, timeout: int = 300):
    return subprocess.run([sys.executable, "-m", "anygpu.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def test_generate_answers_and_ends_with_the_summary_line(smollm_path):  # noqa: F811
    run = anygpu("generate", "What is the capital of France?")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "The capital of France is Paris."
    summary = run.stderr.strip().splitlines()[-1]
    for field in ("backend=cpu", "model=SmolLM2-135M-Instruct.Q4_1.gguf", "prompt_tokens=37", "generated_tokens=8",
                  "ttft=", "tokens/s=", "peak_memory="):
        assert field in summary, summary


def test_chat_keeps_history(smollm_path):  # noqa: F811
    run = anygpu("chat", "--max-tokens", "24", stdin="What is the capital of France?\nAnd of Italy?\n/exit\n")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout
    assert "Rome" in run.stdout  # "And of Italy?" only makes sense with the first turn in the prompt
    assert run.stderr.count("[anygpu] backend=cpu") == 2


def test_bad_arguments_are_named():
    run = anygpu("generate", "hi", "--model", "/nonexistent/model.gguf")
    assert run.returncode != 0 and "/nonexistent/model.gguf" in run.stderr
    run = anygpu("generate", "hi", "--top-p", "0")
    assert run.returncode != 0 and "top_p" in run.stderr


def test_bench_model_writes_json(tmp_path):
    out = tmp_path / "model.json"
    run = anygpu("bench", "model", "--random-config", "tiny", "--num-prompts", "6", "--concurrency", "3",
                 "--input-len", "24", "--output-len", "8", "--no-baseline", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    r = report["results"]["anygpu"]
    assert r["requests"] == 6 and r["output_tokens"] == 48
    assert r["ttft_s"]["p50"] > 0 and r["tpot_s"]["p99"] >= r["tpot_s"]["p50"]
    assert 0 < r["itl_s"]["p50"] <= r["itl_s"]["p99"]  # 42 gaps: 6 requests of 8 tokens
    assert "ITL ms" in run.stdout
    assert "out tok/s" in run.stdout
    if report["device"] == "cpu":  # CPU numbers say which instruction set made them
        capability = torch.backends.cpu.get_cpu_capability()
        assert report["cpu_capability"] == capability and f"on cpu ({capability}, " in run.stdout


def test_bench_model_samples_at_a_temperature_against_a_sampling_baseline(tmp_path):
    """``--temperature``: every request samples (engine and transformers alike); the workload line says so."""
    out = tmp_path / "model.json"
    run = anygpu("bench", "model", "--random-config", "tiny", "--num-prompts", "4", "--concurrency", "2",
                 "--input-len", "16", "--output-len", "6", "--temperature", "1.0", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["workload"].endswith("temperature 1.0")
    assert report["results"]["anygpu"]["output_tokens"] == 24
    assert report["results"]["transformers"]["output_tokens"] == 24
    bad = anygpu("bench", "model", "--random-config", "tiny", "--temperature", "-1")
    assert bad.returncode != 0 and "--temperature" in bad.stderr
