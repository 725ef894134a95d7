"""``anygpu tune`` over several devices (on the CPU: worker processes), and from a model config."""

import json
import os

import pytest
import torch
from click.testing import CliRunner

from anygpu.cli import cli
from anygpu.tunable import multi_device, results, warmup
from anygpu.tunable.signatures import parse_signatures

from .test_tunable import tun  # noqa: F401 - the fixture: CPU backend, tmp_path files, short budgets

FAST = ["--max-iterations", "2", "--max-duration-ms", "1"]
# One operand of this GEMM is 2^48 elements: allocating it fails at once on any machine (address space).
HUGE = "GemmTunableOp_float_TN,tn_16777216_16777216_16777216_ld_16777216_16777216_16777216"
UNTUNED = [
    "GemmTunableOp_float_TN,tn_12_5_16_ld_16_16_12", "GemmTunableOp_float_TN,tn_12_3_16_ld_16_16_12",
    "GemmTunableOp_float_TN,tn_8_3_16_ld_16_16_8", "GemmTunableOp_float_TN,tn_8_1_16_ld_16_16_8",
    "GemmAndBiasTunableOp_float_TN,tn_12_5_16_ld_16_16_12", "GemmAndBiasTunableOp_float_TN,tn_8_2_16_ld_16_16_8",
    "GemmStridedBatchedTunableOp_float_NN,nn_4_2_5_B_3_ld_4_5_4", "GemmTunableOp_float_NN,nn_6_2_4_ld_6_4_6",
]


def _untuned_file(path, lines) -> str:
    # The format record-untuned writes (test_tunable checks that), plus an op we do not tune and a repeat.
    path.write_text("\n".join([*lines, "ScaledGemmTunableOp_Float8_e4m3fn_Float8_e4m3fn_Half_TN,tn_16_16_16", lines[0]])
                    + "\n")
    return str(path)


def _result_lines(path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.startswith("Validator,")]


# --- --devices ---------------------------------------------------------------------------------------------


def test_devices_pick_gpus_by_count_all_or_ordinals():
    ordinals = lambda text: [w.device for w in multi_device.parse_devices(text, "rocm", 4)]  # noqa: E731
    assert ordinals("2") == ["cuda:0", "cuda:1"]
    assert ordinals("all") == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert ordinals("0,2,3") == ["cuda:0", "cuda:2", "cuda:3"] and ordinals(" 3, ") == ["cuda:3"]
    for bad, why in [("5", "1 to 4"), ("0", "1 to 4"), ("0,4", "device 4 does not exist"), ("1,1", "twice"),
                     ("a", "expected N"), ("0,x", "'x'"), ("-1,0", "'-1'"), ("", "expected N")]:
        with pytest.raises(ValueError, match=why):
            multi_device.parse_devices(bad, "cuda", 4)
    cpu = multi_device.parse_devices("2", "cpu", 1, cpu_limit=4)
    assert [w.device for w in cpu] == ["cpu", "cpu"] and [w.name for w in cpu] == ["cpu#0", "cpu#1"]
    assert len(multi_device.parse_devices("all", "cpu", 1)) == 1
    with pytest.raises(ValueError, match="no device ordinals"):
        multi_device.parse_devices("0,1", "cpu", 1)
    with pytest.raises(ValueError, match="1 to 4"):
        multi_device.parse_devices("5", "cpu", 1, cpu_limit=4)
    assert multi_device.split(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]


@pytest.mark.parametrize("value", ["0", "1,1", "two", "0,1"])
def test_bad_devices_are_a_usage_error_naming_the_option(tun, value):
    result = CliRunner().invoke(cli, ["tune", "--shape", "1,8,16", "--devices", value])
    assert result.exit_code == 2 and "--devices" in result.output, result.output
    assert not list(tun.glob("*.csv"))


def test_two_worker_processes_tune_each_recorded_gemm_into_the_file_once(tun):
    untuned = _untuned_file(tun / "untuned.csv", UNTUNED)
    out = tun / "par%d.csv"
    result = CliRunner().invoke(cli, ["tune", "--untuned", untuned, "--shape", "2,8,16", "--devices", "2",
                                      "--output", str(out), *FAST])
    assert result.exit_code == 0, result.output
    lines = _result_lines(tun / "par0.csv")
    assert all(len(line.split(",")) == 4 for line in lines), "torn line"
    keys = [",".join(line.split(",")[:2]) for line in lines]
    assert sorted(keys) == sorted([*UNTUNED, "GemmTunableOp_float_TN,tn_8_2_16_ld_16_16_8"])  # each exactly once
    assert results.read(str(tun / "par0.csv"), results.current_validators(0)) is not None  # our validators
    assert "cpu#0" in result.output and "cpu#1" in result.output  # the work was split between the two
    assert not list(tun.glob(".*.tmp"))


def _flaky_worker(number, worker, backend_name, settings, threads, items, messages):
    """Worker 1 tunes its first item, then dies as a crash would (exit code 3); worker 0 is the real one."""
    if number == 1:
        multi_device._worker_main(number, worker, backend_name, settings, threads, items[:1], messages)
        os._exit(3)
    multi_device._worker_main(number, worker, backend_name, settings, threads, items, messages)


def test_a_failing_gemm_and_a_dying_worker_are_reported_and_the_rest_is_kept(tun):
    lines = [*UNTUNED[:2], HUGE, *UNTUNED[2:5]]  # worker 0: items 0, 2 (HUGE), 4; worker 1: items 1, 3, 5
    work = [multi_device.Work(*line.split(","), label="untuned") for line in lines]
    settings = {"filename": str(tun / "res%d.csv"), "max_tuning_iterations": 2, "max_tuning_duration_ms": 1.0,
                "rotating_buffer_size_mb": 0}
    report = multi_device.run(work, multi_device.parse_devices("2", "cpu", 1, cpu_limit=2), settings, progress=False,
                          target=_flaky_worker)
    assert not report.ok
    text = "\n".join(report.failures)
    assert f"cpu#0: {HUGE} (untuned): RuntimeError" in text  # the GEMM that failed, with its device
    assert "cpu#1: the worker exited with code 3, after 1 of 3 GEMMs" in text
    by_key = {f"{r.work.op_signature},{r.work.params_signature}": r for r in report.rows}
    worker0 = lines[0::2]
    worker1 = lines[1::2]
    assert by_key[HUGE].solution is None and by_key[HUGE].worker == "cpu#0"
    assert [by_key[k].error for k in worker1[1:]] == ["not tuned: its worker stopped"] * 2
    saved = [",".join(line.split(",")[:2]) for line in _result_lines(tun / "res0.csv")]
    assert sorted(saved) == sorted([k for k in worker0 if k != HUGE] + worker1[:1])  # nothing lost
    assert report.paths == [str(tun / "res0.csv")]


def test_a_failing_gemm_makes_the_command_fail_after_tuning_the_others(tun):
    untuned = _untuned_file(tun / "untuned.csv", [HUGE, *UNTUNED[:2]])
    result = CliRunner().invoke(cli, ["tune", "--untuned", untuned, "--output", str(tun / "one%d.csv"), *FAST])
    assert result.exit_code == 1 and "1 failure(s)" in result.output and "cpu: " + HUGE in result.output
    assert sorted(",".join(line.split(",")[:2]) for line in _result_lines(tun / "one0.csv")) == sorted(UNTUNED[:2])


def test_sharing_merges_entries_between_devices_with_the_same_validators(tmp_path):
    same = {"ANYGPU_VERSION": "t", "ARCH": "gfx942"}
    other = {"ANYGPU_VERSION": "t", "ARCH": "gfx1100"}
    paths = [str(tmp_path / f"r{i}.csv") for i in range(3)]
    workers = multi_device.parse_devices("3", "cuda", 3)
    rows = [multi_device.Row(multi_device.Work("GemmTunableOp_Half_TN", f"tn_8_{i + 1}_16_ld_16_16_8"), w.name,
                             "Default", 0.5) for i, w in enumerate(workers)]
    results.merge_write(paths[1], same, [results.Entry("GemmTunableOp_Half_TN", "tn_8_1_16_ld_16_16_8", "Mine", 1.0)])
    multi_device._share(rows, workers, {0: (same, paths[0]), 1: (same, paths[1]), 2: (other, paths[2])})
    first = results.read(paths[0], same).entries
    second = results.read(paths[1], same).entries
    assert set(first) == set(second) == {("GemmTunableOp_Half_TN", "tn_8_1_16_ld_16_16_8"),
                                         ("GemmTunableOp_Half_TN", "tn_8_2_16_ld_16_16_8")}
    assert second[("GemmTunableOp_Half_TN", "tn_8_1_16_ld_16_16_8")].solution == "Mine"  # its own entry is kept
    assert not os.path.exists(paths[2])  # another arch gets nothing (its worker wrote its own, here nothing)


# --- --model-config ------------------------------------------------------------------------------------------

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False}


def test_decoder_linears_are_the_fused_shapes_our_engine_runs():
    assert warmup.decoder_linears(LLAMA3_8B) == [
        ("qkv_proj", 6144, 4096, False), ("o_proj", 4096, 4096, False), ("gate_up_proj", 28672, 4096, False),
        ("down_proj", 4096, 14336, False), ("lm_head", 128256, 4096, False)]
    # An explicit head_dim (Qwen3, Gemma: heads * head_dim != hidden), no GQA key, Qwen2's q/k/v bias.
    qwen = {"model_type": "qwen2", "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}
    assert warmup.decoder_linears(qwen)[:2] == [("qkv_proj", 96 * 128, 2560, True), ("o_proj", 2560, 4096, False)]
    assert warmup.config_dtype(LLAMA3_8B) == torch.bfloat16
    assert warmup.config_dtype({"dtype": "float16"}) == torch.float16 and warmup.config_dtype({}) is None


@pytest.mark.parametrize("change, key", [
    ({"hidden_size": None}, "'hidden_size'"), ({"vocab_size": "32000"}, "vocab_size"),
    ({"intermediate_size": True}, "intermediate_size"), ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"hidden_size": 4095}, "head_dim is absent"), ({"head_dim": 0}, "head_dim"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"), ({"num_local_experts": 8}, "num_local_experts"),
])
def test_bad_or_missing_config_keys_are_named(change, key):
    config = {k: v for k, v in {**LLAMA3_8B, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=key):
        warmup.decoder_linears(config)


def test_read_model_config_takes_the_file_or_its_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": LLAMA3_8B, "model_type": "llava"}))
    assert warmup.read_model_config(str(tmp_path)) == LLAMA3_8B  # a multimodal config's text model
    assert warmup.read_model_config(str(tmp_path / "config.json")) == LLAMA3_8B
    with pytest.raises(ValueError, match="does not exist"):
        warmup.read_model_config(str(tmp_path / "nothere"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json"):
        warmup.read_model_config(str(tmp_path / "bad.json"))


def test_cli_tunes_a_model_config_at_the_batch_sizes(tun):
    config = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 40, "attention_bias": True, "torch_dtype": "bfloat16"}
    (tun / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(cli, ["tune", "--model-config", str(tun), "--batch-sizes", "1,3", "--dtype", "fp32",
                                      "--output", str(tun / "m%d.csv"), *FAST])
    assert result.exit_code == 0, result.output
    saved = {parse_signatures(*line.split(",")[:2]) for line in _result_lines(tun / "m0.csv")}
    expected = {warmup.shape_problem(m, n, k, torch.float32, bias)
                for _, n, k, bias in warmup.decoder_linears(config) for m in (1, 3)}
    assert saved == expected and len(expected) == 10  # --dtype beats the config's torch_dtype
    assert "qkv_proj M=3" in result.output and "GemmAndBiasTunableOp_float_TN" in result.output
    bad = CliRunner().invoke(cli, ["tune", "--model-config", str(tun), "--batch-sizes", "0,1"])
    assert bad.exit_code == 2 and "--batch-sizes" in bad.output
    (tun / "config.json").write_text(json.dumps({**config, "num_attention_heads": "4"}))
    bad = CliRunner().invoke(cli, ["tune", "--model-config", str(tun)])
    assert bad.exit_code == 2 and "--model-config" in bad.output and "num_attention_heads" in bad.output
