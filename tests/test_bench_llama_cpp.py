"""``anygpu bench model --llama-bench PATH``: llama.cpp's llama-bench as a baseline in the same run.

The parser reads output the real tool wrote (tests/data/llama-bench-tg32.json); the CLI's refusals come before
anything runs.  A real run needs a llama.cpp build, which CI does not have: set LLAMA_BENCH to its llama-bench.
"""

import json
import os
import pathlib
import sys

import pytest

from anygpu.bench.llama_cpp import check_binary, parse_output, run_llama_bench

from .test_cli_engine import anygpu

DATA = pathlib.Path(__file__).parent / "data" / "llama-bench-tg32.json"


def test_parses_the_tools_own_output():
    test = parse_output(DATA.read_text())
    assert test["n_gen"] == 32 and test["n_prompt"] == 0 and test["n_threads"] == 1
    assert test["avg_ts"] == pytest.approx(107.162455)
    assert test["avg_ns"] == pytest.approx(32 / test["avg_ts"] * 1e9, rel=0.01)


@pytest.mark.parametrize("text,match", [
    ("| model | size |", "unparseable"),
    ("[]", "a JSON list of one test"),
    ('[{"avg_ts": 1.0}, {"avg_ts": 2.0}]', "a JSON list of one test"),
    ('[{"avg_ts": "fast", "stddev_ts": 1, "n_gen": 1, "n_threads": 1, "avg_ns": 1}]', "no number 'avg_ts'"),
    ('[{"avg_ts": 0, "stddev_ts": 0, "n_gen": 0, "n_threads": 1, "avg_ns": 1}]', "token generation test"),
])
def test_bad_output_is_named(text, match):
    with pytest.raises(ValueError, match=match):
        parse_output(text, "llama-bench (x)")


def test_binary_must_be_an_executable(tmp_path):
    with pytest.raises(ValueError, match="--llama-bench: .*no such file"):
        check_binary(str(tmp_path / "llama-bench"))
    plain = tmp_path / "plain"
    plain.write_text("")
    plain.chmod(0o644)
    with pytest.raises(ValueError, match="not executable"):
        check_binary(str(plain))
    assert check_binary(sys.executable) == os.path.abspath(sys.executable)


@pytest.mark.parametrize("args,match", [
    (["--llama-bench", "/nonexistent/llama-bench"], "no such file"),
    (["--random-config", "tiny", "--num-prompts", "1"], "not --random-config"),
    (["--num-prompts", "2"], "expected --num-prompts 1"),
    (["--num-prompts", "1", "--quantize", "nf4"], "include the unquantized model"),
])
def test_refusals_come_before_any_run(args, match):
    if "--llama-bench" not in args:
        args = [*args, "--llama-bench", sys.executable]
    run = anygpu("bench", "model", "--no-baseline", *args, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "--llama-bench" in run.stderr and match in run.stderr, run.stderr
    assert "Loading" not in run.stderr  # no model was built


def test_serve_suite_refuses_it():
    run = anygpu("bench", "serve", "--llama-bench", sys.executable, timeout=60)
    assert run.returncode == 2 and "--llama-bench" in run.stderr, run.stderr


def test_a_failing_tool_is_a_clear_error(tmp_path):
    fake_exit = tmp_path / "llama-bench"
    fake_exit.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    fake_exit.chmod(0o755)
    with pytest.raises(RuntimeError, match="(?s)exited with code 1.*failed to load model"):
        run_llama_bench(str(fake_exit), "missing.gguf", output_len=4, threads=1)


@pytest.mark.skipif(not os.environ.get("LLAMA_BENCH"), reason="set LLAMA_BENCH to a llama.cpp llama-bench to run")
def test_real_run_on_the_default_model(tmp_path):
    out = tmp_path / "model.json"
    run = anygpu("bench", "model", "--num-prompts", "1", "--input-len", "8", "--output-len", "16", "--threads", "1",
                 "--no-baseline", "--llama-bench", os.environ["LLAMA_BENCH"], "--json", str(out))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["results"]["llama.cpp"]["output_tokens"] == 16
    assert report["results"]["llama.cpp"]["llama_bench"]["n_threads"] == 1
    assert 0 < report["vs_llama_cpp"]
    assert "anygpu / llama.cpp decode tokens/s" in run.stdout
