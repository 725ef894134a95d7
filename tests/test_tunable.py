"""TunableOp: controls, the results file, lookup / tuning decisions, warmup and the CLI (CPU)."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from anygpu import backend, tunable
from anygpu.tunable import candidates, controls, results
from anygpu.tunable.signatures import bmm_problem, linear_problem, mm_problem, parse_signatures


@pytest.fixture
def tun(tmp_path, monkeypatch):
    """A clean TunableOp state writing into tmp_path, with short timing budgets, on the CPU backend (these
    tests use CPU tensors, which a GPU backend deliberately leaves untuned)."""
    monkeypatch.setenv("ANYGPU_BACKEND", "cpu")
    backend.reset()
    for var in list(os.environ):
        if var.startswith(controls.ENV_PREFIX):
            monkeypatch.delenv(var)
    controls.reload_env()
    tunable.clear_explicit()
    controls.set(filename=str(tmp_path / "results%d.csv"), untuned_filename=str(tmp_path / "untuned.csv"),
                 max_tuning_iterations=3, max_tuning_duration_ms=1, rotating_buffer_size_mb=0)
    tunable.reset()
    yield tmp_path
    for c in list(candidates._extra):
        candidates.remove(c.name)
    for var in list(os.environ):
        if var.startswith(controls.ENV_PREFIX):
            monkeypatch.delenv(var)
    tunable.clear_explicit()
    controls.reload_env()
    tunable.reset()
    backend.reset()  # chosen again, from the restored environment, on next use


def _xw(m=5, n=12, k=16, bias=False):
    x, w = torch.randn(m, k), torch.randn(n, k)
    return x, w, (torch.randn(n) if bias else None)


# --- controls -------------------------------------------------------------------------------------------------


def test_environment_sets_controls_and_an_explicit_call_beats_it(tun, monkeypatch):
    monkeypatch.setenv("ANYGPU_TUNABLEOP_TUNING", "0")
    monkeypatch.setenv("ANYGPU_TUNABLEOP_MAX_TUNING_ITERATIONS", "7")
    monkeypatch.setenv("ANYGPU_TUNABLEOP_NUMERICAL_CHECK", "1e-3_2e-3")
    controls.reload_env()
    assert not tunable.tuning_is_enabled()
    assert tunable.current().max_tuning_iterations == 3  # set explicitly by the fixture: beats the env
    assert tunable.current().tolerance(torch.float16) == (1e-3, 2e-3)
    tunable.tuning_enable(True)
    assert tunable.tuning_is_enabled()
    with tunable.settings(tuning=False, record_untuned=True):
        assert not tunable.tuning_is_enabled() and tunable.record_untuned_is_enabled()
    assert tunable.tuning_is_enabled() and not tunable.record_untuned_is_enabled()
    tunable.clear_explicit("tuning", "max_tuning_iterations")
    assert not tunable.tuning_is_enabled() and tunable.current().max_tuning_iterations == 7


def test_bad_values_name_the_argument_or_variable(tun, monkeypatch):
    with pytest.raises(ValueError, match="max_tuning_iterations"):
        controls.set(max_tuning_iterations=0)
    with pytest.raises(ValueError, match="atol, rtol"):
        tunable.set_numerical_check_tolerances(True, atol=1e-3)
    with pytest.raises(ValueError, match="unknown setting"):
        controls.set(colour="blue")
    monkeypatch.setenv("ANYGPU_TUNABLEOP_ENABLED", "maybe")
    with pytest.raises(ValueError, match="ANYGPU_TUNABLEOP_ENABLED"):
        controls.reload_env()
    monkeypatch.setenv("ANYGPU_TUNABLEOP_ENABLED", "1")
    monkeypatch.setenv("ANYGPU_TUNABLEOP_NUMERICAL_CHECK", "0_1e-3")
    with pytest.raises(ValueError, match="ANYGPU_TUNABLEOP_NUMERICAL_CHECK"):
        controls.reload_env()


@pytest.mark.parametrize("name, expected", [("res%d.csv", "res3.csv"), ("tunableop_results.csv", "tunableop_results3.csv"),
                                            ("results", "results3"), ("dir.v2/results", "dir.v2/results3")])
def test_device_ordinal_goes_where_pytorch_puts_it(name, expected):
    assert controls.device_filename(name, 3) == expected


def test_disabled_calls_torch_and_writes_nothing(tun):
    tunable.enable(False)
    x, w, b = _xw(bias=True)
    torch.testing.assert_close(tunable.linear(x, w, b), F.linear(x, w, b))
    assert not list(tun.glob("*.csv"))


# --- signatures ---------------------------------------------------------------------------------------------


def test_signatures_are_pytorchs_blas_order():
    x, w = torch.empty(7, 28672, device="meta"), torch.empty(8192, 28672, device="meta")
    p = linear_problem(x, w, False)
    assert (p.op_signature(), p.params_signature()) == ("GemmTunableOp_Float_TN".replace("Float", "float"),
                                                        "tn_8192_7_28672_ld_28672_28672_8192")
    assert parse_signatures(p.op_signature(), p.params_signature()) == p
    assert mm_problem(x, w.t()) == p  # the same BLAS call
    a, b = torch.empty(2, 3, 4, dtype=torch.half, device="meta"), torch.empty(2, 4, 5, dtype=torch.half, device="meta")
    q = bmm_problem(a, b)
    assert q.params_signature() == "nn_5_3_4_B_2_ld_5_4_5" and parse_signatures(q.op_signature(), q.params_signature()) == q
    old = parse_signatures("GemmTunableOp_Half_TN", "tn_8192_7_28672")  # PyTorch < 2.6: no leading dims
    assert old == linear_problem(x.half(), w.half(), False)
    assert parse_signatures("ScaledGemmTunableOp_Float8_e4m3fnuz_Float8_e4m3fnuz_Half_TN", "tn_1_2_3") is None


# --- results file -------------------------------------------------------------------------------------------


def test_results_file_round_trip():
    validators = {"ANYGPU_VERSION": "0.1.0", "PT_VERSION": "2.13.0"}
    entries = [results.Entry("GemmTunableOp_Half_TN", "tn_8_1_16_ld_16_16_8", "Default", 0.125),
               results.Entry("GemmTunableOp_Half_TN", "tn_8_2_16_ld_16_16_8", "Blas_cublaslt", 0.5)]
    text = results.format_file(validators, entries)
    parsed = results.parse(text)
    assert parsed.validators == validators
    assert list(parsed.entries.values()) == entries


PYTORCH_ROCM_FILE = """\
Validator,PT_VERSION,2.3.0
Validator,ROCM_VERSION,6.1.0.0-82-5fabb4c
Validator,HIPBLASLT_VERSION,0.7.0-1549b021
Validator,GCN_ARCH_NAME,gfx942:sramecc+:xnack-
Validator,ROCBLAS_VERSION,4.1.0-cefa4a9b-dirty
GemmTunableOp_Half_TN,tn_8192_7_28672,Gemm_Rocblas_45475,0.132098
GemmTunableOp_Half_TN,tn_8192_1_28672,Gemm_Hipblaslt_TN_10814,0.131953
GemmTunableOp_Half_TN,tn_32000_6_8192,Default,0.149546
"""


def test_pytorch_file_is_read_and_unknown_ops_and_solutions_run_as_default(tun):
    pt = torch.__version__.split("+")[0]
    (tun / "results0.csv").write_text(
        f"Validator,PT_VERSION,{pt}\n"
        "GemmTunableOp_float_TN,tn_12_5_16_ld_16_16_12,Gemm_Rocblas_-1140856325,0.01\n"
        "GemmAndBiasTunableOp_float_TN,tn_12_5_16_ld_16_16_12,Default,0.02,BLAS_PARAMS: - { function: matmul }\n"
        "ScaledGemmTunableOp_Float8_e4m3fn_Float8_e4m3fn_BFloat16_TN,tn_16_16_16_ld_16_16_16_rw_0_bias_None,Default,1\n"
        "GemmTunableOp_float_NN,nn_1_1_1_ld_1_1_1\n")
    x, w, b = _xw(bias=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(tunable.linear(x, w), F.linear(x, w))
        torch.testing.assert_close(tunable.linear(x, w, b), F.linear(x, w, b))
    assert not tunable.ops.last_outcomes  # both were found in the file: nothing tuned
    assert len(tunable.table(0)) == 3


def test_pytorch_file_from_another_machine_is_ignored_with_the_mismatch_named(tun):
    (tun / "results0.csv").write_text(PYTORCH_ROCM_FILE)
    with pytest.warns(results.ResultsWarning, match="PT_VERSION|GCN_ARCH_NAME"):
        assert tunable.table(0) == {}


def test_our_file_with_other_validators_is_ignored_then_moved_aside(tun):
    good = results.current_validators(0)
    stale = {**good, "ANYGPU_VERSION": "0.0.1"}
    x, w, _ = _xw()
    p = linear_problem(x, w, False)
    (tun / "results0.csv").write_text(results.format_file(stale, [results.Entry(p.op_signature(),
                                                                                 p.params_signature(), "Default", 1)]))
    with pytest.warns(results.ResultsWarning, match="ANYGPU_VERSION.*0.0.1"):
        tunable.linear(x, w)
    assert p in tunable.ops.last_outcomes  # tuned again
    assert (tun / "results0.csv.stale").exists()
    assert results.read(str(tun / "results0.csv"), good).validators == good


def test_unparsable_lines_are_skipped_with_a_warning(tun):
    x, w, _ = _xw()
    p = linear_problem(x, w, False)
    text = results.format_file(results.current_validators(0), [results.Entry(p.op_signature(), p.params_signature(),
                                                                             "Default", 0.5)])
    (tun / "results0.csv").write_text(text + "garbage\nGemmTunableOp_float_TN,tn_1_1_1,Default,not-a-time\n\n")
    with pytest.warns(results.ResultsWarning, match="could not parse") as caught:
        table = tunable.table(0)
    assert len(caught) == 2 and list(table) == [p]


def test_a_failed_write_warns_and_keeps_the_result(tun):
    controls.set(filename=str(tun / "missing-dir-is-a-file" / "r.csv"))
    (tun / "missing-dir-is-a-file").write_text("not a directory")
    x, w, _ = _xw()
    with pytest.warns(results.ResultsWarning, match="cannot (read|save)"):
        tunable.linear(x, w)
    assert len(tunable.table(0)) == 1


# --- lookup and tuning -----------------------------------------------------------------------------------------


def test_miss_tunes_once_then_hits_in_this_and_a_new_process(tun):
    x, w, b = _xw(bias=True)
    torch.testing.assert_close(tunable.linear(x, w, b), F.linear(x, w, b))
    p = linear_problem(x, w, True)
    assert list(tunable.ops.last_outcomes) == [p]
    tunable.ops.last_outcomes.clear()
    tunable.linear(x, w, b)
    assert not tunable.ops.last_outcomes
    tunable.reset()  # as a new process would: read the file
    tunable.linear(x, w, b)
    assert not tunable.ops.last_outcomes
    line = f"{p.op_signature()},{p.params_signature()},Default,"
    assert line in (tun / "results0.csv").read_text()


def test_mm_and_bmm_match_torch_for_transposed_operands(tun):
    a, b = torch.randn(6, 10), torch.randn(10, 7)
    torch.testing.assert_close(tunable.mm(a, b), a @ b)
    torch.testing.assert_close(tunable.mm(a.t().contiguous().t(), b.t().contiguous().t()), a @ b)
    a3, b3 = torch.randn(3, 6, 10), torch.randn(3, 10, 7)
    torch.testing.assert_close(tunable.bmm(a3, b3), a3 @ b3)
    x3 = torch.randn(2, 3, 16)
    w = torch.randn(12, 16)
    torch.testing.assert_close(tunable.linear(x3, w), F.linear(x3, w))
    assert len(tunable.ops.last_outcomes) == 4


def test_bad_input_raises_value_error_naming_the_argument(tun):
    with pytest.raises(ValueError, match="weight"):
        tunable.linear(torch.randn(3, 5), torch.randn(4, 6))
    with pytest.raises(ValueError, match="bias"):
        tunable.linear(torch.randn(3, 5), torch.randn(4, 5), torch.randn(3))
    with pytest.raises(ValueError, match="x: expected float16"):
        tunable.linear(torch.ones(3, 5, dtype=torch.int32), torch.ones(4, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="b: expected a shape"):
        tunable.mm(torch.randn(3, 5), torch.randn(4, 6))
    assert not list(tun.glob("*.csv"))


def _cached_linear(x, w, b):
    """A 'solution' that is correct and nearly free for one problem: it must win."""
    out = F.linear(x, w, b)
    return lambda *_: out


def test_failing_or_wrong_candidates_never_win(tun):
    x, w, b = _xw(m=64, n=128, k=256, bias=True)
    fast_wrong = torch.zeros(64, 128)

    def boom(*_):
        raise RuntimeError("unsupported")

    candidates.add(candidates.Candidate("Boom", boom, boom, boom))
    candidates.add(candidates.Candidate("Wrong", lambda *_: fast_wrong, boom, boom))
    candidates.add(candidates.Candidate("NaN", lambda *_: torch.full((64, 128), float("nan")), boom, boom))
    candidates.add(candidates.Candidate("Cached", _cached_linear(x, w, b), boom, boom))
    tunable.linear(x, w, b)
    outcome = tunable.ops.last_outcomes[linear_problem(x, w, True)]
    assert outcome.solution == "Cached"
    assert "failed: RuntimeError" in outcome.report["Boom"]
    assert "numerical check" in outcome.report["Wrong"] and "numerical check" in outcome.report["NaN"]
    candidates.remove("Cached")
    tunable.reset()
    (tun / "results0.csv").unlink()
    torch.testing.assert_close(tunable.linear(x, w, b), F.linear(x, w, b))
    assert tunable.ops.last_outcomes[linear_problem(x, w, True)].solution == "Default"


def test_a_win_must_be_confirmed_against_default(tun):
    import time

    x, w, b = _xw(m=64, n=128, k=256, bias=True)
    out = F.linear(x, w, b)
    calls = []

    def lucky_then_slow(*_):  # fast through the first timing pass (7 calls), then 50 ms a call
        calls.append(1)
        if len(calls) > 7:
            time.sleep(0.05)
        return out

    candidates.add(candidates.Candidate("Lucky", lucky_then_slow, torch.mm, torch.bmm))
    tunable.linear(x, w, b)
    outcome = tunable.ops.last_outcomes[linear_problem(x, w, True)]
    assert len(calls) > 7, "the first pass took more calls than this test assumes"
    assert outcome.solution == "Default", (len(calls), outcome.report)
    assert outcome.report["Lucky"].startswith("not confirmed")


def test_a_winner_in_the_file_that_is_not_offered_here_runs_default(tun):
    x, w, _ = _xw()
    candidates.add(candidates.Candidate("Cached", _cached_linear(x, w, None), torch.mm, torch.bmm))
    tunable.linear(x, w)
    assert "Cached" in (tun / "results0.csv").read_text()
    candidates.remove("Cached")
    tunable.reset()
    x2 = torch.randn_like(x)
    torch.testing.assert_close(tunable.linear(x2, w), F.linear(x2, w))


def test_ship_mode_never_tunes_and_record_untuned_feeds_offline_tuning(tun):
    x, w, b = _xw(bias=True)
    a, bb = torch.randn(3, 2, 5), torch.randn(3, 5, 4)
    with tunable.settings(tuning=False):
        torch.testing.assert_close(tunable.linear(x, w, b), F.linear(x, w, b))
    assert not tunable.ops.last_outcomes and not list(tun.glob("*.csv"))
    with tunable.settings(tuning=False, record_untuned=True):
        tunable.linear(x, w, b)
        tunable.linear(x, w, b)
        tunable.bmm(a, bb)
        tunable.mm(x, w.t())
    assert not tunable.ops.last_outcomes
    lines = (tun / "untuned0.csv").read_text().splitlines()
    p = linear_problem(x, w, True)
    assert sorted(lines) == sorted([f"{p.op_signature()},{p.params_signature()}",
                                    "GemmStridedBatchedTunableOp_float_NN,nn_4_2_5_B_3_ld_4_5_4",
                                    "GemmTunableOp_float_TN,tn_12_5_16_ld_16_16_12"])
    tuned = tunable.tune_untuned_file(str(tun / "untuned0.csv"), torch.device("cpu"), progress=False)
    assert sorted(q.op_signature() for q, _ in tuned) == sorted(line.split(",")[0] for line in lines)
    saved = results.read(str(tun / "results0.csv"), results.current_validators(0))
    assert {(q.op_signature(), q.params_signature()) for q, _ in tuned} == set(saved.entries)


# --- model warmup and routing --------------------------------------------------------------------------------------


def test_tune_model_tunes_each_linear_shape_and_route_uses_them(tun):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False), nn.Linear(16, 32))
    model[3] = model[0]  # a repeated shape is tuned once
    problems = tunable.tune_model(model, batch_sizes=(1, 2, 4), progress=False)
    assert len(set(problems)) == 6 and len(tunable.ops.last_outcomes) == 6
    tunable.ops.last_outcomes.clear()
    x = torch.randn(2, 16)
    expected = model[2](model[1](model[0](x)))
    with tunable.route(model):
        assert "forward" in model[0].__dict__
        got = model[2](model[1](model[0](x)))
    assert "forward" not in model[0].__dict__
    torch.testing.assert_close(got, expected)
    assert not tunable.ops.last_outcomes  # every shape was a hit
    with pytest.raises(ValueError, match="batch_sizes"):
        tunable.tune_model(model, batch_sizes=(0,))


def test_numerical_check_rejects_nan_and_large_errors():
    ref = torch.tensor([1.0, -2.0, 3.0])
    assert tunable.tuner.numerically_close(ref + 1e-4, ref, 1e-3, 1e-3)
    assert not tunable.tuner.numerically_close(ref + 1e-1, ref, 1e-3, 1e-3)
    assert not tunable.tuner.numerically_close(torch.tensor([1.0, float("nan"), 3.0]), ref, 1, 1)


def test_cli_tune_writes_the_results_file(tun):
    from click.testing import CliRunner

    from anygpu.cli import cli

    out = tun / "cli%d.csv"
    result = CliRunner().invoke(cli, ["tune", "--shape", "3,8,16", "--shape", "1,8,16", "--dtype", "fp32",
                                      "--output", str(out), "--max-iterations", "2"])
    assert result.exit_code == 0, result.output
    text = (tun / "cli0.csv").read_text()
    assert "tn_8_3_16_ld_16_16_8" in text and "tn_8_1_16_ld_16_16_8" in text
    bad = CliRunner().invoke(cli, ["tune", "--shape", "3,8"])
    assert bad.exit_code != 0 and "M,N,K" in bad.output


def test_bench_suite_builds_tuned_cases_on_the_cpu(tun):
    from anygpu.bench import load_suites

    cases = load_suites()["tunable"](torch.device("cpu"), quick=True)
    assert [c.op for c in cases][-1] == "tunable_lookup"
    for case in cases:
        torch.testing.assert_close(case.ours(), case.baselines["torch"]())
