"""The ``anygpu`` command line."""

from __future__ import annotations

import json
import sys
import warnings

import click

from ._version import __version__


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
    from .diagnostics.doctor import collect, render, target_list

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
@click.option("--json", "json_path", default=None, metavar="PATH", help="Where to write the JSON results.")
@click.option("--png", "png_path", default=None, metavar="PATH", help="Where to write a chart (needs matplotlib).")
def bench(suite, list_suites, quick, json_path, png_path):
    """Run a benchmark SUITE on this backend against its baselines."""
    from . import bench as harness

    harness.load_suites()
    if list_suites or not suite:
        for name, fn in sorted(harness.SUITES.items()):
            click.echo(f"{name:14s} {getattr(fn, 'description', '')}")
        return
    if suite not in harness.SUITES:
        raise click.BadParameter(f"expected one of {', '.join(sorted(harness.SUITES))}, got {suite!r}",
                                 param_hint="SUITE")
    report = harness.run(suite, quick=quick)
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


@cli.command()
@click.option("--shape", "shapes", multiple=True, metavar="M,N,K",
              help="A linear to tune: x[M, K] @ W[N, K]^T (tokens, out features, in features). Repeatable.")
@click.option("--dtype", default=None, type=click.Choice(sorted(DTYPES)),
              help="dtype of --shape GEMMs (default: bf16 on GPUs, fp32 on the CPU).")
@click.option("--bias", is_flag=True, help="Tune the --shape GEMMs with a bias (GemmAndBias).")
@click.option("--untuned", "untuned_path", default=None, metavar="FILE",
              help="Tune every GEMM recorded in this untuned file (written with ANYGPU_TUNABLEOP_RECORD_UNTUNED=1).")
@click.option("--output", default=None, metavar="FILE",
              help="Results file ('%d' becomes the device ordinal). Default: ANYGPU_TUNABLEOP_FILENAME or "
                   "anygpu_tunableop_results.csv (ordinal inserted).")
@click.option("--max-iterations", type=click.IntRange(min=1), default=None, help="Timed calls per candidate, at most.")
@click.option("--max-duration-ms", type=click.FloatRange(min=0), default=None, help="Timing budget per candidate.")
def tune(shapes, dtype, bias, untuned_path, output, max_iterations, max_duration_ms):
    """Tune GEMMs ahead of time into the TunableOp results file (one GPU: torch's current device).

    Spreading an untuned file over several GPUs in parallel processes is not implemented yet (issue 5).
    """
    import torch

    from . import backend, tunable

    if not shapes and not untuned_path:
        raise click.UsageError("give at least one --shape M,N,K or --untuned FILE")
    parsed = [_parse_shape(s) for s in shapes]
    device = backend.device()
    torch_dtype = getattr(torch, DTYPES[dtype] if dtype else ("bfloat16" if device.type == "cuda" else "float32"))
    values = {"enabled": True, "tuning": True}
    if output:
        values["filename"] = output
    if max_iterations:
        values["max_tuning_iterations"] = max_iterations
    if max_duration_ms is not None:
        values["max_tuning_duration_ms"] = max_duration_ms
    rows = []
    with tunable.settings(**values) as s:
        if parsed:
            for problem, entry in tunable.tune_shapes(parsed, torch_dtype, device, bias=bias):
                rows.append([entry.op_signature, entry.params_signature, entry.solution, f"{entry.time_ms:.4g}"])
        if untuned_path:
            try:
                tuned = tunable.tune_untuned_file(untuned_path, device)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--untuned") from e
            ordinal = max(device.index or 0, 0)
            for problem, solution in tuned:
                entry = tunable.table(ordinal).get(problem)
                rows.append([problem.op_signature(), problem.params_signature(), solution,
                             f"{entry.time_ms:.4g}" if entry else "-"])
        path = s.results_path(max(device.index or 0, 0))
    from tabulate import tabulate

    click.echo(tabulate(rows, ["op", "params", "solution", "ms"]))
    click.echo(f"results in {path}")


@cli.command()
def targets():
    """The GPU targets anygpu knows, with their limits."""
    from tabulate import tabulate

    from .backend.targets import CI_TARGETS, TARGETS

    rows = [[t.arch, t.vendor, t.family, t.warp_size, f"{t.shared_per_block // 1024} KiB", ",".join(t.fp8) or "-",
             t.matrix_unit, "yes" if t.arch in CI_TARGETS else "", t.products] for t in TARGETS.values()]
    click.echo(tabulate(rows, ["arch", "vendor", "family", "wave", "LDS/smem per block", "fp8", "matrix", "CI",
                               "products"]))


def main(argv=None):
    # triton 3.9 warns on every compile that a default will change in 3.10; it is noise for CLI users.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")
    cli.main(args=argv, prog_name="anygpu")


if __name__ == "__main__":
    main()
