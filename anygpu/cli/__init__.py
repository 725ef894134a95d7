"""The ``anygpu`` command line."""

from __future__ import annotations

import json
import sys
import warnings

import click

from .._version import __version__
from .extras import require
from .generate import apply_threads, model_spec, quiet_option


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="anygpu")
def cli():
    """anygpu: LLM kernels, quantization and tuned GEMMs on ROCm, CUDA and the CPU."""


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--targets", default=None, metavar="LIST",
              help="Cross-compile every kernel for these targets: comma-separated (gfx942,sm_90), 'ci' or 'all'. "
                   "Default: this GPU's arch (none on the CPU).")
@click.option("--no-probe", is_flag=True, help="Skip compiling and running a kernel on this machine.")
def doctor(as_json, targets, no_probe):
    """Backend chosen and why, GPUs, versions, whether Triton works here, cross-compile table."""
    from ..diagnostics.doctor import collect, render, target_list

    try:
        target_objs = target_list(targets)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--targets") from e
    report = collect(target_objs, probe=not no_probe)
    click.echo(json.dumps(report, indent=2, default=str) if as_json else render(report))
    sys.exit(0 if report["ok"] else 1)


@cli.command()
@click.argument("suite", required=False)
@click.option("--list", "list_suites", is_flag=True, help="List the suites.")
@click.option("--quick", is_flag=True, help="Small shapes (a smoke run).")
@click.option("--op", "ops", multiple=True, metavar="NAME",
              help="Kernel suites: only the cases of this op (repeatable; e.g. matmul_q4_k in the quant suite).")
@click.option("--json", "json_path", default=None, metavar="PATH", help="Where to write the JSON results.")
@click.option("--png", "png_path", default=None, metavar="PATH", help="Where to write a chart (needs matplotlib).")
@click.option("--model", default=None, metavar="PATH|ORG/NAME[:TAG]",
              help="model and serve suites: a GGUF file, an HF folder or a Hub id in the HF cache (default model).")
@click.option("--gguf-file", default=None, metavar="FILE",
              help="The .gguf file to run inside --model (a folder or a Hub repo).")
@click.option("--random-config", default=None, metavar="NAME",
              help="model suite: random weights in these shapes instead of --model (llama3-8b, tiny).")
@click.option("--quantize", default=None, metavar="LIST",
              help="model and serve suites: nf4, fp4, int8, q4_0, q4_k or q8_0 (GGUF blocks); the model suite also takes a comma list with bf16 / "
                   "none for the unquantized model (bf16,nf4,int8): each runs on the same workload, ratios in one run.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=64, show_default=True, help="model suite.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None, help="model suite (default: all prompts).")
@click.option("--input-len", type=click.IntRange(min=1), default=512, show_default=True, help="model suite.")
@click.option("--output-len", type=click.IntRange(min=1), default=256, show_default=True, help="model suite.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="model suite: 0 decodes greedily; above 0 every request samples at it (vLLM's throughput "
                   "benchmark uses 1.0), transformers' baseline too.")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="model suite: also run transformers' generate on the same workload. serve suite: also run the "
                   "offline engine on the same workload.")
@click.option("--llama-bench", "llama_bench", default=None, metavar="PATH",
              help="model suite, one prompt, a GGUF model: also run llama.cpp's llama-bench (this executable) on "
                   "the same file and threads, and print the decode-rate ratio.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="model and serve suites.")
@click.option("--threads", type=click.IntRange(min=1), default=None, expose_value=False, callback=apply_threads,
              help="CPU threads for torch's ops, as for `anygpu generate` (default: half the usable cores).")
@click.option("--url", default=None, help="serve suite: load this running server instead of starting one.")
@click.option("--api-key", envvar="ANYGPU_API_KEY", default=None, help="serve suite, with --url.")
@click.option("--request-rate", type=click.FloatRange(min=0, min_open=True), default=float("inf"),
              help="serve suite: Poisson arrivals at this many requests/s (default: all at once).")
@click.option("--half-load", is_flag=True,
              help="serve suite: then run again at half the measured peak request rate (TTFT at moderate load).")
@click.option("--disconnect-fraction", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="serve suite: this fraction of requests leave mid-stream.")
@click.option("--client-procs", type=click.IntRange(min=1), default=4, show_default=True,
              help="serve suite: load-generator processes.")
@click.option("--n", "n", type=click.IntRange(1, 16), default=1, show_default=True,
              help="serve suite: choices per request (OpenAI's n); above 1, the run is repeated with n = 1 on as "
                   "many prompts and the output tokens/s ratio printed.")
@quiet_option("No progress bars.", expose_value=False)
def bench(suite, list_suites, quick, ops, json_path, png_path, tp, url, api_key, request_rate, half_load,
          disconnect_fraction, client_procs, n, **model_options):
    """Run a benchmark SUITE on this backend against its baselines.

    `anygpu bench model` is the engine's offline throughput (the model-suite options); `anygpu bench serve` the
    HTTP server's, with vLLM's serving metrics."""
    from .. import bench as harness

    harness.load_suites()
    if list_suites or not suite:
        for name, fn in sorted(harness.SUITES.items()):
            click.echo(f"{name:14s} {getattr(fn, 'description', '')}")
        click.echo(f"{'model':14s} the engine's offline throughput, TTFT and TPOT vs transformers' generate")
        click.echo(f"{'serve':14s} the HTTP server under load: TTFT, TPOT, ITL, throughput vs the offline engine")
        return
    gguf_file = model_options.pop("gguf_file")
    if suite in ("model", "serve"):
        if ops:
            raise click.BadParameter("a kernel-suite option (the model and serve suites run whole models)",
                                     param_hint="--op")
        model_options["model"] = model_spec(model_options["model"], gguf_file)
    if suite == "model":
        require("llm", "anygpu bench model")
        from .bench_model import bench_model

        bench_model(json_path=json_path or "bench-results/model.json", tp=tp, **model_options)
        return
    if suite == "serve":
        require("serve", "anygpu bench serve")
        from .bench_model import single_quantize
        from .bench_serve import bench_serve

        model_options["quantize"] = single_quantize(model_options["quantize"])
        if model_options.pop("llama_bench") is not None:
            raise click.BadParameter("a model-suite option (one prompt against llama-bench's tg test)",
                                     param_hint="--llama-bench")
        if model_options.pop("temperature"):
            raise click.BadParameter("expected 0 for the serve suite (its requests' sampling is the load's); "
                                     "--temperature is a model-suite option", param_hint="--temperature")
        bench_serve(json_path=json_path or "bench-results/serve.json", tp=tp, url=url, api_key=api_key,
                    request_rate=request_rate, half_load=half_load, disconnect_fraction=disconnect_fraction,
                    client_procs=client_procs, n=n, **model_options)
        return
    if suite not in harness.SUITES:
        raise click.BadParameter(f"expected one of {', '.join(sorted(harness.SUITES))}, got {suite!r}",
                                 param_hint="SUITE")
    try:
        report = harness.run(suite, quick=quick, ops=ops)
    except ValueError as e:
        if not str(e).startswith("ops:"):
            raise
        raise click.BadParameter(str(e).removeprefix("ops: "), param_hint="--op") from e
    click.echo(report.table())
    json_path = json_path or f"bench-results/{suite}.json"
    report.write_json(json_path)
    click.echo(f"wrote {json_path}")
    png_path = png_path or json_path.rsplit(".", 1)[0] + ".png"
    if report.write_png(png_path):
        click.echo(f"wrote {png_path}")


DTYPES = {"fp16": "float16", "float16": "float16", "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp32": "float32", "float32": "float32", "float": "float32"}


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.split(","))
    except ValueError:
        m = n = k = 0
    if min(m, n, k) < 1:
        raise click.BadParameter(f"expected M,N,K (three positive ints: tokens, out features, in features), got {text!r}",
                                 param_hint="--shape")
    return m, n, k


def _parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"expected comma-separated positive token counts (1,2,4,8), got {text!r}",
                                 param_hint="--batch-sizes")
    return tuple(dict.fromkeys(sizes))


@cli.command()
@click.option("--shape", "shapes", multiple=True, metavar="M,N,K",
              help="A linear to tune: x[M, K] @ W[N, K]^T (tokens, out features, in features). Repeatable.")
@click.option("--dtype", default=None, type=click.Choice(sorted(DTYPES)),
              help="dtype of --shape and --model-config GEMMs (default: the config's torch_dtype for "
                   "--model-config, else bf16 on GPUs, fp32 on the CPU).")
@click.option("--bias", is_flag=True, help="Tune the --shape GEMMs with a bias (GemmAndBias).")
@click.option("--model-config", "model_config", default=None, metavar="PATH",
              help="A Hugging Face config.json (or its directory) of a Llama-family decoder: tune its fused "
                   "qkv_proj, o_proj, fused gate_up_proj, down_proj and lm_head at --batch-sizes tokens.")
@click.option("--batch-sizes", "batch_sizes", default=None, metavar="LIST",
              help="Token counts (M) for --model-config. Default: 1,2,4,8,16,32.")
@click.option("--untuned", "untuned_path", default=None, metavar="FILE",
              help="Tune every GEMM recorded in this untuned file (written with ANYGPU_TUNABLEOP_RECORD_UNTUNED=1).")
@click.option("--devices", default=None, metavar="N|all|LIST",
              help="Spread the work over several GPUs, one worker process each: N (the first N), 'all', or "
                   "ordinals (0,2,3; '3,' for one). Each GPU writes its own ordinal's results file; at the end "
                   "GPUs with identical validators get each other's entries. On the CPU backend: N worker "
                   "processes. Default: this process, torch's current device.")
@click.option("--output", default=None, metavar="FILE",
              help="Results file ('%d' becomes the device ordinal). Default: ANYGPU_TUNABLEOP_FILENAME or "
                   "anygpu_tunableop_results.csv (ordinal inserted).")
@click.option("--max-iterations", type=click.IntRange(min=1), default=None, help="Timed calls per candidate, at most.")
@click.option("--max-duration-ms", type=click.FloatRange(min=0), default=None, help="Timing budget per candidate.")
@quiet_option("No progress bars.", expose_value=False)
def tune(shapes, dtype, bias, model_config, batch_sizes, untuned_path, devices, output, max_iterations,
         max_duration_ms):
    """Tune GEMMs ahead of time into the TunableOp results file: --shape, --model-config, --untuned (any mix).

    Exit status 1 when a GEMM or a worker failed, or a results file could not be written; what the others tuned
    is in the results files (each written whole or not at all).
    """
    import dataclasses
    import os

    import torch

    from .. import backend, tunable
    from ..tunable import multi_device, warmup

    if not shapes and not untuned_path and not model_config:
        raise click.UsageError("give at least one --shape M,N,K, --model-config PATH or --untuned FILE")
    if batch_sizes is not None and not model_config:
        raise click.UsageError("--batch-sizes applies to --model-config")
    parsed = [_parse_shape(s) for s in shapes]
    sizes = _parse_batch_sizes(batch_sizes) if batch_sizes is not None else warmup.DEFAULT_BATCH_SIZES
    backend_name = backend.name()
    if devices is None:
        device = backend.device()
        workers = [multi_device.Worker(str(device), str(device))]
    else:
        count = backend.module().device_count() if backend_name != "cpu" else 1
        try:
            workers = multi_device.parse_devices(devices, backend_name, count)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--devices") from e
    default_dtype = getattr(torch, DTYPES[dtype] if dtype else ("bfloat16" if backend_name != "cpu" else "float32"))

    work = []
    for m, n, k in parsed:
        p = warmup.shape_problem(m, n, k, default_dtype, bias)
        work.append(multi_device.Work(p.op_signature(), p.params_signature(), f"--shape {m},{n},{k}"))
    if model_config:
        try:
            config = warmup.read_model_config(model_config)
            linears = warmup.decoder_linears(config)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--model-config") from e
        model_dtype = default_dtype if dtype else (warmup.config_dtype(config) or default_dtype)
        for name, n, k, has_bias in linears:
            for m in sizes:
                p = warmup.shape_problem(m, n, k, model_dtype, has_bias)
                work.append(multi_device.Work(p.op_signature(), p.params_signature(), f"{name} M={m}"))
    if untuned_path:
        try:
            problems = warmup.untuned_problems(untuned_path)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--untuned") from e
        work += [multi_device.Work(p.op_signature(), p.params_signature(), "untuned") for p in problems]
    unique: dict = {}
    for w in work:  # a GEMM asked for twice is tuned once, under the first label
        unique.setdefault((w.op_signature, w.params_signature), w)
    work = list(unique.values())

    values = {"enabled": True, "tuning": True, "record_untuned": False}
    if output:
        values["filename"] = output
    if max_iterations:
        values["max_tuning_iterations"] = max_iterations
    if max_duration_ms is not None:
        values["max_tuning_duration_ms"] = max_duration_ms
    with tunable.settings(**values) as s:
        report = multi_device.run(work, workers, dataclasses.asdict(s))
    from tabulate import tabulate

    head = ["device"] if len(workers) > 1 else []
    rows = [([r.worker] if head else []) + [r.work.label, r.work.op_signature, r.work.params_signature,
                                            r.solution or "FAILED", f"{r.time_ms:.4g}" if r.solution else "-"]
            for r in report.rows]
    click.echo(tabulate(rows, head + ["for", "op", "params", "solution", "ms"]))
    if report.write_errors:
        # Said on stderr and in the exit status: "results in FILE" for a file that was not written would send
        # the user to a file that does not hold them.
        source = "--output" if output else "ANYGPU_TUNABLEOP_FILENAME" if os.environ.get(
            "ANYGPU_TUNABLEOP_FILENAME") else "the default results file"
        for line in report.write_errors:
            click.echo(f"error: {source}: cannot write the results: {line}", err=True)
    click.echo(f"results in {', '.join(report.paths) or '(nothing written)'}")
    if report.failures:
        click.echo(f"{len(report.failures)} failure(s):", err=True)
        for line in report.failures:
            click.echo(f"  {line}", err=True)
    if not report.ok:
        sys.exit(1)


@cli.command()
def targets():
    """The GPU targets anygpu knows, with their limits."""
    from tabulate import tabulate

    from ..backend.targets import CI_TARGETS, TARGETS

    rows = [[t.arch, t.vendor, t.family, t.warp_size, f"{t.shared_per_block // 1024} KiB", ",".join(t.fp8) or "-",
             t.matrix_unit, "yes" if t.arch in CI_TARGETS else "", t.products] for t in TARGETS.values()]
    click.echo(tabulate(rows, ["arch", "vendor", "family", "wave", "LDS/smem per block", "fp8", "matrix", "CI",
                               "products"]))


from .chat import chat  # noqa: E402 - the engine's commands live in their own files
from .generate import generate  # noqa: E402

cli.add_command(generate)
cli.add_command(chat)

from .serve import serve  # noqa: E402

cli.add_command(serve)


def main(argv=None):
    # triton 3.9 warns on every compile that a default will change in 3.10; it is noise for CLI users.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")
    cli.main(args=argv, prog_name="anygpu")


if __name__ == "__main__":
    main()
