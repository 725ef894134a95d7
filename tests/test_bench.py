"""The benchmark harness on the CPU: what it records and how it reports.  Never asserts on how fast
anything is: times depend on the machine and its neighbours."""

from __future__ import annotations

import json
import time

import pytest
import torch

from anygpu import bench
from anygpu.bench import Case, Report
from anygpu.bench.timing import measure

CPU = torch.device("cpu")
FAST = {"progress": False, "device": CPU, "warmup_ms": 2, "rep_ms": 10}  # keeps the file quick


@pytest.fixture(scope="module")
def report() -> Report:
    return bench.run("elementwise", quick=True, **FAST)


@pytest.fixture
def throwaway_suite():
    """Register suites under test-only names, and remove them afterwards."""
    names = []

    def register(name, make):
        bench.suite(name, "test only")(make)
        names.append(name)

    yield register
    for name in names:
        bench.SUITES.pop(name, None)


def test_rows_have_positive_times_and_ratios_from_them(report):
    assert report.suite == "elementwise" and report.quick
    assert report.rows and all(row["op"] == "silu_and_mul" for row in report.rows)
    assert report.copy_bandwidth_Bps > 0
    assert report.matmul_peak_flops is None  # no case counts FLOPs, so the peak is not measured
    for row in report.rows:
        ours = row["ours"]
        assert ours["ms"] > 0
        assert ours["GBps"] == pytest.approx(row["bytes"] / (ours["ms"] / 1e3) / 1e9)
        assert ours["copy_bw_fraction"] == pytest.approx(ours["GBps"] * 1e9 / report.copy_bandwidth_Bps)
        assert ours["TFLOPs"] is None and ours["matmul_peak_fraction"] is None
        assert set(row["baselines"]) == {"torch", "copy"}
        for entry in row["baselines"].values():
            assert entry["ms"] > 0
            assert entry["ratio"] == pytest.approx(entry["ms"] / ours["ms"])


def test_bytes_count_input_read_and_output_written_once(report):
    for row in report.rows:
        tokens, width = (int(n) for n in row["shape"].split()[0].split("x"))
        assert row["bytes"] == (tokens * width + tokens * width // 2) * 4  # fp32 on the CPU


def test_table_has_headers_and_rows(report):
    text = report.table()
    for header in ("op", "shape", "ours ms", "torch ms", "copy ms", "vs torch", "vs copy", "GB/s", "% copy BW"):
        assert header in text
    assert "TFLOP/s" not in text  # no case counts FLOPs: no empty columns
    assert "silu_and_mul" in text and "copy bandwidth" in text
    assert text.count("silu_and_mul") == len(report.rows)
    ratio = report.rows[0]["baselines"]["torch"]["ratio"]
    assert f"{ratio:.2f}x" in text


def test_json_round_trips_and_is_written(report, tmp_path):
    path = report.write_json(tmp_path / "sub" / "elementwise.json")
    assert path.exists()
    assert [p.name for p in path.parent.iterdir()] == ["elementwise.json"]  # no temp file left behind
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(report.to_json()))
    assert data["backend"]["name"] == "cpu" and data["versions"]["torch"] == torch.__version__
    assert Report.from_json(data).table() == report.table()


def test_png_is_written_with_matplotlib(report, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "elementwise.png"
    assert report.write_png(path) is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_suite_names_the_argument_and_the_known_suites():
    with pytest.raises(ValueError, match=r"suite: unknown suite 'no_such_suite'.*elementwise"):
        bench.run("no_such_suite", **FAST)


def test_failing_baseline_is_recorded_not_raised(throwaway_suite):
    n = 64
    a, b = torch.randn(n, n), torch.randn(n, n)

    def broken():
        raise RuntimeError("baseline broke\nsecond line")

    throwaway_suite("_test_broken_baseline", lambda device, quick: [
        Case("mm", f"{n}^3", lambda: a @ b, {"broken": broken, "torch": lambda: torch.mm(a, b)},
             bytes=3 * n * n * 4, flops=2 * n**3)])
    report = bench.run("_test_broken_baseline", **FAST)
    (row,) = report.rows
    assert row["baselines"]["broken"] == {"error": "RuntimeError: baseline broke"}
    assert row["baselines"]["torch"]["ratio"] > 0
    # A case that counts FLOPs makes the run measure the matmul peak, and the table report against it.
    assert report.matmul_peak_flops > 0 and report.matmul_peak_dtype == "float32"
    assert row["ours"]["matmul_peak_fraction"] == pytest.approx(row["ours"]["TFLOPs"] * 1e12 / report.matmul_peak_flops)
    text = report.table()
    assert "error" in text and "baseline broke" in text and "% matmul peak" in text


def test_failing_ours_raises(throwaway_suite):
    def broken():
        raise RuntimeError("ours broke")

    throwaway_suite("_test_broken_ours", lambda device, quick: [Case("x", "1", broken, {"copy": lambda: None})])
    with pytest.raises(RuntimeError, match="ours broke"):
        bench.run("_test_broken_ours", **FAST)


def test_ops_pick_cases_and_unknown_ops_are_named(throwaway_suite):
    a = torch.randn(8, 8)
    throwaway_suite("_test_ops", lambda device, quick: [
        Case("add", "8x8", lambda: a + a), Case("mul", "8x8", lambda: a * a), Case("mul", "8x8 again", lambda: a * a)])
    report = bench.run("_test_ops", ops=("mul",), **FAST)
    assert [(r["op"], r["shape"]) for r in report.rows] == [("mul", "8x8"), ("mul", "8x8 again")]
    with pytest.raises(ValueError, match=r"ops: suite '_test_ops' has no cases of sub; its ops: add, mul"):
        bench.run("_test_ops", ops=("mul", "sub"), **FAST)


def test_case_checks_its_arguments():
    with pytest.raises(ValueError, match="bytes"):
        Case("x", "1", lambda: None, bytes=-1)
    with pytest.raises(ValueError, match="baselines"):
        Case("x", "1", lambda: None, {"ours": lambda: None})
    with pytest.raises(ValueError, match="ours"):
        Case("x", "1", None)


def test_suite_name_is_checked():
    with pytest.raises(ValueError, match="name"):
        bench.suite("not a name", "bad")


def test_measure_returns_a_median_and_checks_its_arguments():
    assert measure(lambda: None, device=CPU, warmup_ms=0, rep_ms=1) >= 0
    with pytest.raises(ValueError, match="rep_ms"):
        measure(lambda: None, device=CPU, rep_ms=0)
    with pytest.raises(ValueError, match="warmup_ms"):
        measure(lambda: None, device=CPU, warmup_ms=-1)


def test_graph_timing_is_eager_on_the_cpu(throwaway_suite):
    x = torch.randn(8, 16)
    throwaway_suite("_test_graph_cpu", lambda device, quick: [Case("silu", "8x16", lambda: torch.nn.functional.silu(x),
                                                                   bytes=2 * x.nbytes, graph=True)])
    (row,) = bench.run("_test_graph_cpu", **FAST).rows
    assert row["timing"] == "eager"


@pytest.mark.gpu
def test_graph_timing_on_the_gpu(throwaway_suite):
    from anygpu.bench.timing import measure_graph
    from anygpu.ops import silu_and_mul

    x = torch.randn(1, 2 * 4096, device="cuda", dtype=torch.bfloat16)
    assert measure_graph(lambda: silu_and_mul(x), device=x.device, warmup_ms=2, rep_ms=10) > 0
    throwaway_suite("_test_graph_gpu", lambda device, quick: [Case("silu_and_mul", "1x8192", lambda: silu_and_mul(x),
                                                                   {"torch": lambda: x[:, :4096] * 2},
                                                                   bytes=x.nbytes * 3 // 2, graph=True)])
    report = bench.run("_test_graph_gpu", progress=False, warmup_ms=2, rep_ms=10)
    (row,) = report.rows
    assert row["timing"] == "graph" and row["baselines"]["torch"]["ratio"] > 0
    assert "[graph]" in report.table()


def test_cpu_timing_reports_its_spread_and_warns_when_it_is_large(monkeypatch):
    from anygpu.bench import timing

    x = torch.randn(256, 256)
    ms = measure(lambda: x @ x, device=CPU, warmup_ms=1, rep_ms=100)
    assert ms > 0 and timing.last_cpu_spread is not None and timing.last_cpu_spread >= 0
    # A call that turns 5x slower a tenth of a second in: the early and late blocks differ, and it says so.
    def uneven():
        time.sleep(0.0005 if time.perf_counter() - t0 > 0.1 else 0.0001)

    monkeypatch.setattr(timing, "SPREAD_WARNING", 0.05)
    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match="spread"):
        measure(uneven, device=CPU, warmup_ms=0, rep_ms=300)


@pytest.mark.parametrize("quantize", [None, "nf4", "int8"])
def test_decode_step_bytes_count_every_weight_once_and_the_kv_cache(quantize):
    """A decode step reads each weight once (quantized: the codes and their scales), the input embedding only
    for the looked-up rows, and each sequence's K and V over its context."""
    from anygpu.bench.model import decode_step_bytes, random_engine

    engine = random_engine("tiny", quantize=quantize, max_num_seqs=2, max_model_len=64)
    try:
        model, cfg = engine.model, engine.config
        embed = model.embed_tokens.weight
        weights = {id(t): t for t in model.parameters()}
        extra = 0
        if quantize == "nf4":  # each block's absmax (double quant: uint8 codes, their scales and table), the maps
            held = {}
            for p in model.parameters():
                qs = getattr(p, "quant_state", None)
                for s in (qs, getattr(qs, "state2", None)):
                    for t in (getattr(s, "absmax", None), getattr(s, "code", None), getattr(s, "offset", None)):
                        if t is not None:
                            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            extra = sum(held.values())
        if quantize == "int8":  # one fp32 scale per output row
            extra = sum(p.SCB.nbytes for p in model.parameters() if getattr(p, "SCB", None) is not None)
        expect = sum(t.untyped_storage().nbytes() for t in weights.values()) - embed.nbytes + extra
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.runner.kv_cache.element_size()
        assert decode_step_bytes(engine, 3, 10.5) == expect + 3 * 10.5 * per_token
    finally:
        engine.close()


def test_cli_op_option_runs_those_cases_only(tmp_path):
    import subprocess
    import sys

    def anygpu(*args):
        return subprocess.run([sys.executable, "-m", "anygpu.cli", "bench", *args], capture_output=True, text=True,
                              timeout=600)

    out = tmp_path / "q.json"
    run = anygpu("quant", "--quick", "--op", "matmul_q4_k", "--json", str(out), "-q")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and {r["op"] for r in rows} == {"matmul_q4_k"}
    run = anygpu("quant", "--quick", "--op", "no_such_op")
    assert run.returncode == 2 and "--op" in run.stderr and "no_such_op" in run.stderr and "matmul_q4_k" in run.stderr
    run = anygpu("model", "--op", "matmul_q4_k")
    assert run.returncode == 2 and "--op" in run.stderr and "kernel-suite option" in run.stderr
