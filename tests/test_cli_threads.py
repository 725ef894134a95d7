"""``--threads`` (generate, chat, serve, bench) and ``--quantize`` (``anygpu bench model``'s lists; the types the
engine commands take): parsing and errors, and real generate runs with the options."""

from __future__ import annotations

import os
import subprocess
import sys

import click
import pytest
import torch

from anygpu.cli.bench_model import parse_quantize, single_quantize
from anygpu.cli.generate import apply_threads, default_threads

from ._models_fixtures import smollm_path  # noqa: F401 - fixture


def anygpu(*args, timeout: int = 300):
    return subprocess.run([sys.executable, "-m", "anygpu.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"], ["bench", "model"]])
@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_thread_counts_are_named(command, value):
    run = anygpu(*command, "--threads", value)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--threads" in run.stderr


def test_default_is_half_the_usable_cores():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_threads() == max(1, cores // 2)


def test_the_option_sets_torch_and_the_environment(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert apply_threads(None, None, 3) == 3
        assert torch.get_num_threads() == 3 and os.environ["OMP_NUM_THREADS"] == "3"
        assert apply_threads(None, None, None) == default_threads()
        assert torch.get_num_threads() == default_threads()
    finally:
        torch.set_num_threads(before)


def test_generate_with_threads(smollm_path):  # noqa: F811
    run = anygpu("generate", "What is the capital of France?", "--threads", "1", "--max-tokens", "8")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout


def test_quantize_lists():
    assert parse_quantize(None) == [None]
    assert parse_quantize("nf4") == ["nf4"]
    assert parse_quantize("bf16,nf4,int8") == [None, "nf4", "int8"]
    assert parse_quantize(" None , FP4") == [None, "fp4"]
    assert single_quantize("int8") == "int8" and single_quantize("none") is None


@pytest.mark.parametrize("text, message", [("nf4,q4", "'q4'"), ("nf4,,int8", "''"), ("bf16,none", "once"),
                                           ("int8,int8", "once")])
def test_bad_quantize_lists_are_named(text, message):
    with pytest.raises(click.BadParameter, match=message) as info:
        parse_quantize(text)
    assert info.value.param_hint == "--quantize"


def test_bench_cli_names_a_bad_quantize_entry_before_loading_anything():
    run = anygpu("bench", "model", "--random-config", "tiny", "--quantize", "bf16,nf3", "--no-baseline")
    assert run.returncode == 2 and "--quantize" in run.stderr and "'nf3'" in run.stderr
    run = anygpu("bench", "serve", "--random-config", "tiny", "--quantize", "nf4,int8")
    assert run.returncode == 2 and "--quantize" in run.stderr and "one format" in run.stderr


def test_bench_model_runs_each_variant_on_one_workload(tmp_path):
    import json

    out = tmp_path / "model.json"
    run = anygpu("bench", "model", "--random-config", "tiny", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "4", "--quantize", "none,nf4,int8", "--threads", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    # the unquantized entry is named by the dtype the engine really used (float32 on the CPU)
    base = "bfloat16" if torch.cuda.is_available() else "float32"
    assert list(report["results"]) == [f"anygpu {base}", "anygpu nf4", "anygpu int8", f"transformers {base}"]
    assert all(r["output_tokens"] == 8 for r in report["results"].values())
    assert report["vs_unquantized"][f"anygpu {base}"] == 1.0 and report["threads"] == 1
    ours = {k: r for k, r in report["results"].items() if k.startswith("anygpu")}
    assert all(r["bandwidth_share"] > 0 and r["bandwidth_limit_tpot_s"] > 0 for r in ours.values())
    # quantized weights are fewer bytes a step
    assert ours["anygpu nf4"]["decode_step_bytes"] < ours["anygpu int8"]["decode_step_bytes"] \
        < ours[f"anygpu {base}"]["decode_step_bytes"]
    assert report["speedup"] > 0 and "vs the unquantized engine" in run.stdout


def test_bench_serve_n_repeats_the_run_with_one_choice(tmp_path):
    import json

    out = tmp_path / "serve.json"
    run = anygpu("bench", "serve", "--random-config", "tiny", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "4", "--n", "3", "--client-procs", "1", "--threads", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == ["offline", "server", "server_n1"] and "n=3" in report["workload"]
    # every choice of every request is counted: 2 prompts x 3 choices x 4 tokens, against 2 x 4 with n = 1
    assert results["server"]["total_output_tokens"] == 24 and results["server_n1"]["total_output_tokens"] == 8
    assert report["n_speedup"] == pytest.approx(results["server"]["output_throughput"]
                                                / results["server_n1"]["output_throughput"])
    assert anygpu("bench", "serve", "--n", "17").returncode == 2


def test_generate_and_serve_take_every_quantize_type_the_engine_builds():
    from anygpu.cli.bench_model import QUANTIZE_CHOICES
    from anygpu.cli.generate import ENGINE_OPTIONS
    from anygpu.models.registry import QUANT_TYPES

    assert QUANTIZE_CHOICES == QUANT_TYPES

    def probe(**kwargs):
        pass

    for option in ENGINE_OPTIONS:  # the options generate, chat and serve share
        probe = option(probe)
    choice = next(p for p in click.command()(probe).params if p.name == "quantize").type
    assert tuple(choice.choices) == QUANT_TYPES


def test_generate_with_a_gguf_quantize_type(smollm_path):  # noqa: F811
    """q4_k on SmolLM2: its 576-input layers fall back to Q8_0 (a warning), the 1536-input ones take Q4_K."""
    run = anygpu("generate", "What is the capital of France?", "--quantize", "q4_k", "--threads", "1",
                 "--max-tokens", "8")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "in q8_0 instead of q4_k" in run.stderr
    assert run.stdout.strip()
