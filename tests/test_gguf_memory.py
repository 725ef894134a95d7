"""Memory of GGUF loading on the CPU (issue 23): peak resident set measured in fresh subprocesses
(``resource.getrusage``), so neither the test process nor other tests' allocations count.

- the loader: opening the default SmolLM2 Q4_1 file and decoding every tensor (each dropped after use) must hold
  about one fp32 tensor at a time, not the file's metadata as numpy views or a tensor's several fp32 copies;
- ``anygpu generate``, packed (the default): its peak over a bare ``import`` of the engine stays within the file's
  size plus a bounded margin: the weights stay packed, the model is built without PyTorch's meta-tensor Python
  machinery, Triton is not imported, and packing's temporaries do not stay resident
  (docs/perf/2026-12-02-cpu-peak-rss.md); dequantized to fp32: within the fp32 weights plus a bounded margin;
- building a model imports neither sympy nor torch._dynamo (a regression of the above, found early).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ._models_fixtures import smollm_path  # noqa: F401 - fixture

MiB = 2**20
_PEAK = "import resource, json; print(json.dumps({'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))"


def _run(code: str, **env_vars: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **env_vars)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _imports_peak() -> int:
    return _run("import torch, anygpu.engine, anygpu.cli, anygpu.models; " + _PEAK)["peak"]


def test_loader_holds_one_tensor_at_a_time(smollm_path):  # noqa: F811
    base = _imports_peak()
    got = _run(f"""
import torch, anygpu.engine, anygpu.cli
from anygpu.models import GGUFCheckpoint
ckpt = GGUFCheckpoint({str(smollm_path)!r})
largest = 0
for name, w in ckpt.weights(progress=False):
    largest = max(largest, w.numel() * w.element_size())
    del w
import resource, json
print(json.dumps({{"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "largest": largest}}))""")
    over = got["peak"] - base
    # one fp32 tensor (the 113 MiB embedding) + the tokenizer + chunk temporaries; GGUFReader and whole-tensor
    # fp32 temporaries took ~440 MiB here
    assert over < got["largest"] + 120 * MiB, (over / MiB, got["largest"] / MiB)


@pytest.mark.parametrize("packed", ["1", "0"])
def test_generate_peak(smollm_path, packed):  # noqa: F811
    """packed "1": the product's default on the CPU (the conftest turns it off for the other tests); "0": the
    projections dequantized to fp32."""
    base = _imports_peak()
    got = _run(f"""
import sys
sys.argv = ["anygpu", "generate", "What is the capital of France?", "--max-tokens", "8", "--threads", "1"]
from anygpu.cli import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
{_PEAK}""", ANYGPU_CPU_GGUF_PACKED=packed)
    over = got["peak"] - base
    if packed == "1":
        # The packed weights (a little more than the file), the tokenizer and metadata, the model's modules and
        # a few steps' activations.  Each regression this guards against took 70-200 MiB more: Triton imported
        # by the backend's description, the meta-device build's imports, packing temporaries left in the heap.
        file_size = smollm_path.stat().st_size
        assert over < file_size + 90 * MiB, (over / MiB, file_size / MiB)
        return
    from anygpu.models import open_checkpoint

    cfg = open_checkpoint(smollm_path).config
    fp32_weights = 4 * (cfg.vocab_size * cfg.hidden_size + cfg.num_layers * (
        cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size))
    # Before the meta-device build stopped importing PyTorch's symbolic machinery and the engine stopped importing
    # Triton, this was the weights plus ~190 MiB (before the loader work, plus ~480 MiB).
    assert over < fp32_weights + 100 * MiB, (over / MiB, fp32_weights / MiB)


def test_model_build_imports_no_symbolic_machinery(smollm_path):  # noqa: F811
    got = _run(f"""
import sys, json, torch
from anygpu.models import open_checkpoint
from anygpu.models.llama import LlamaForCausalLM
cfg = open_checkpoint({str(smollm_path)!r}).config
before = set(sys.modules)
LlamaForCausalLM(cfg, max_position=64)
print(json.dumps({{"new": sorted(set(sys.modules) - before),
                   "heavy": [m for m in ("sympy", "torch._dynamo") if m in sys.modules]}}))""")
    assert not got["heavy"], got["heavy"]
    assert len(got["new"]) < 10, got["new"]
