"""``anygpu serve``: the OpenAI- and TGI-compatible HTTP server over the engine.

Binds 127.0.0.1 unless ``--host`` says otherwise; with ``--api-key`` (or ``ANYGPU_API_KEY``) every route but
``/health`` and ``/metrics`` needs ``Authorization: Bearer <key>``.  Listening beyond loopback without a key
is allowed but warned about.

The HTTP edge's limits (``--max-request-line`` ... ``--max-connections``) are ``serve.limits.EdgeLimits``;
its docstring has the table of defaults and the status each answers with.  If the engine dies the server
stops and the command exits 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import functools
import os

import click

from ..serve.limits import EdgeLimits

from .extras import require
from .generate import ENGINE_OPTIONS, _options, model_spec


@click.command()
@_options(ENGINE_OPTIONS)
@click.option("--random-config", default=None, metavar="NAME",
              help="Serve random weights in these shapes instead of --model (llama3-8b, tiny): for benchmarks.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="ANYGPU_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (env ANYGPU_API_KEY).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel size: shard the model over this many GPUs (processes over gloo on the CPU).")
@click.option("--served-model-name", multiple=True, metavar="NAME[,NAME...]",
              help="The model names clients may send, repeatable or a comma list; the first is reported (default: "
                   "the model's own name: a GGUF's general.name, the HF repo id or folder name).")
@click.option("--strict-model-name", is_flag=True,
              help="Answer an unknown 'model' with 404 (OpenAI's, vLLM's behaviour); by default any name means the "
                   "one model served (TGI's), and a missing one always does.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None,
              help="Sequences per batch (default 256 on GPUs, 16 on the CPU).")
@click.option("--max-concurrent-requests", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Requests in flight before new ones get 429 with Retry-After.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=4 << 20, show_default=True,
              help="Largest request body accepted (413 above).")
@click.option("--max-request-line", type=click.IntRange(min=1), default=EdgeLimits.max_request_line,
              show_default=True, help="Longest request line in bytes (414 above).")
@click.option("--max-header-bytes", type=click.IntRange(min=1), default=EdgeLimits.max_header_bytes,
              show_default=True, help="Largest request line plus headers in bytes (431 above).")
@click.option("--max-headers", type=click.IntRange(min=1), default=EdgeLimits.max_headers, show_default=True,
              help="Most header lines in a request (431 above).")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=EdgeLimits.header_timeout,
              show_default=True, help="Seconds to receive a request's whole head (408 after, slow clients cut).")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=EdgeLimits.body_timeout,
              show_default=True, help="Seconds to receive a request's whole body after its head (408 after).")
@click.option("--keep-alive-timeout", type=click.FloatRange(min=0, min_open=True),
              default=EdgeLimits.keep_alive_timeout, show_default=True,
              help="Seconds an idle connection is kept open between requests.")
@click.option("--max-connections", type=click.IntRange(min=1), default=EdgeLimits.max_connections,
              show_default=True, help="Open connections before new ones get 503 with Retry-After.")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="Log one line per request (client, method, path, status).")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.05, 0.99), default=0.9, show_default=True)
@click.option("--engine-in-thread", is_flag=True,
              help="Run the engine in a thread of the server's process instead of its own process (they then "
                   "share the GIL: slower under load, but one process).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info")
def serve(model, gguf_file, quantize, dtype, tune, max_model_len, eager, random_config, host, port, api_key, tp,
          served_model_name, strict_model_name, max_num_seqs, max_concurrent_requests, max_body_bytes,
          max_request_line, max_header_bytes, max_headers, header_timeout, body_timeout, keep_alive_timeout,
          max_connections, access_log, gpu_memory_utilization, engine_in_thread, log_level):
    """Serve a model over HTTP: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, TGI's /,
    /generate and /generate_stream, /tokenize, /detokenize, /version, /health and /metrics."""
    require("serve", "anygpu serve")
    from ..engine import AsyncLLMEngine, LLMEngine
    from ..engine.engine_process import EngineClient
    from ..serve import build_app, runner

    from ..serve.names import parse_names

    if model and random_config:
        raise click.UsageError("give --model or --random-config, not both")
    model = model_spec(model, gguf_file)
    try:
        names = parse_names(served_model_name) if served_model_name else None
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("model_name: "), param_hint="--served-model-name") from None
    if api_key is None and "ANYGPU_API_KEY" in os.environ:
        api_key = os.environ["ANYGPU_API_KEY"]  # click reads an empty variable as unset: an open server
    if api_key is not None:
        _check_api_key(api_key)
    limits = EdgeLimits(max_request_line=max_request_line, max_header_bytes=max_header_bytes,
                        max_headers=max_headers, header_timeout=header_timeout, body_timeout=body_timeout,
                        keep_alive_timeout=keep_alive_timeout, max_connections=max_connections)
    if host not in runner.LOOPBACK and api_key is None:
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach this port can use "
                   f"the model", err=True)
    try:
        sock = runner.bind(host, port)  # before loading: a busy port should not cost a model load
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--port") from None
    kwargs = dict(quantize=quantize, dtype=dtype, tune=tune, max_model_len=max_model_len, enforce_eager=eager,
                  max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization, tp=tp)
    if random_config:
        from ..bench.model import random_engine

        factory = functools.partial(random_engine, random_config, **kwargs)
    else:
        factory = functools.partial(LLMEngine, model, **kwargs)
    try:
        # By default the engine gets its own process (its own GIL): the web side never delays a step.
        engine = factory() if engine_in_thread else EngineClient(factory)
    except (ValueError, FileNotFoundError) as e:
        sock.close()
        raise click.ClickException(f"cannot load the model: {e}") from None
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, model_name=names, api_key=api_key,
                    max_body_bytes=max_body_bytes, max_concurrent_requests=max_concurrent_requests,
                    strict_model_name=strict_model_name)
    name = app.state.server.model_name
    click.echo(f"anygpu: serving {name!r} on http://{host}:{sock.getsockname()[1]} (tp={tp}, "
               f"device={engine.device}, dtype={str(engine.dtype).removeprefix('torch.')})", err=True)
    try:
        died = runner.serve(app, sock, log_level=log_level, limits=limits, access_log=access_log,
                            alive=lambda: async_engine.healthy)
    finally:
        async_engine.shutdown()
        engine.close()
    if died:
        raise click.ClickException(f"{died}; exiting so that a supervisor can restart the server")


def _check_api_key(key: str) -> None:
    from ..serve.auth import key_problem

    problem = key_problem(key)
    if problem:
        if not key.strip():
            problem += " (an empty ANYGPU_API_KEY does not turn auth off: unset it)"
        raise click.BadParameter(problem, param_hint="--api-key (or ANYGPU_API_KEY)")
