"""``anygpu bench serve``: the HTTP server under load (``anygpu.bench.serve``), printed and written as JSON.

Without ``--url`` it starts everything itself, in this order:
1. the offline engine on the workload (``--baseline``, the default): the ceiling the server is held to;
2. the server (a real socket on loopback, the load generator in ``--client-procs`` other processes) at
   ``--concurrency`` (and ``--request-rate`` if given): the peak run;
3. with ``--half-load``: again at half the peak run's request rate (TTFT at moderate load);
4. with ``--n`` above 1 (OpenAI's ``n``: choices per request, sharing the prompt's KV blocks): again with one
   choice per request, and the ratio of output tokens/s printed (``n_speedup``).
The server's engine runs in its own process (``EngineClient``), as ``anygpu serve`` runs it; the offline engine
runs in this one and is freed first.
Each run gets its own random prompts (same lengths), so no run is served from another's prefix cache.
"""

from __future__ import annotations

import functools
import json
import math
import os

import click


def bench_serve(*, json_path, model, random_config, quantize, num_prompts, concurrency, input_len, output_len,
                baseline, tp, url, api_key, request_rate, half_load, disconnect_fraction, client_procs, n=1):
    from ..bench import model as bm
    from ..bench import serve as bs

    concurrency = concurrency or num_prompts
    load = dict(output_len=output_len, concurrency=concurrency, disconnect_fraction=disconnect_fraction,
                client_procs=client_procs, n=n)
    report = {"workload": f"{num_prompts} prompts x {input_len} in / {output_len} out, concurrency {concurrency}"
                          + (f", n={n}" if n > 1 else "")
                          + (f", {request_rate:g} req/s" if math.isfinite(request_rate) else ""), "results": {}}
    if url is not None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        info = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
        name = info["data"][0]["id"]
        prompts = bm.random_prompts(num_prompts, input_len, 1000, seed=1)  # ids < 1000 exist in any vocabulary
        records, duration = bs.run_load_in_processes(url.rstrip("/"), name, prompts, request_rate=request_rate,
                                                     api_key=api_key, **load)
        report.update(model=name, device=url)
        report["results"]["server"] = bs.summarize(records, duration)
    else:
        report.update(_self_hosted(bm, bs, model, random_config, quantize, num_prompts, input_len, tp, baseline,
                                   request_rate, half_load, load))
    for name, summary in report["results"].items():
        click.echo(bs.format_summary(name, summary))
    if "n_speedup" in report:
        click.echo(f"n={n} / n=1 output tokens/s: {report['n_speedup']:.3f}")
    if "server_vs_offline" in report:
        click.echo(f"server / offline output tokens/s: {report['server_vs_offline']:.3f}")
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    click.echo(f"wrote {json_path}")


def _self_hosted(bm, bs, model, random_config, quantize, num_prompts, input_len, tp, baseline, request_rate,
                 half_load, load) -> dict:
    from ..engine import AsyncLLMEngine
    from ..engine.engine_process import EngineClient
    from ..serve import ServerThread, build_app
    from .bench_model import free_device, make_engine

    # Each of a request's n choices is a sequence of the batch.
    args = (model, random_config, quantize, load["concurrency"] * load["n"], input_len + load["output_len"], tp)
    out = {"results": {}}
    if baseline:  # the offline engine in this process; freed before the server's engine is built
        engine = make_engine(*args)
        vocab = engine.config.vocab_size
        bm.warm_up(engine, input_len, vocab)
        offline = bm.run_engine(engine, bm.random_prompts(num_prompts, input_len, vocab, seed=0), load["output_len"],
                                load["concurrency"])
        out["results"]["offline"] = _offline_summary(offline, num_prompts * input_len)
        device = engine.device
        engine.close()
        del engine
        free_device(device)
    # The server's engine runs in its own process, as `anygpu serve` runs it.
    engine = EngineClient(functools.partial(make_engine, *args))
    vocab = engine.config.vocab_size
    out.update(model=engine.model_name + (f" ({quantize})" if quantize else "") + (f" tp={tp}" if tp > 1 else ""),
               device=str(engine.device), dtype=str(engine.dtype))
    async_engine = AsyncLLMEngine(engine)
    try:
        with ServerThread(build_app(async_engine)) as server:
            name = server.server.config.app.state.server.model_name
            # Warm-up through the server: the engine process compiles what the timed runs will meet.
            bs.run_load_in_processes(server.url, name, bm.random_prompts(4, input_len, vocab, seed=99), 3, 2)
            runs = [("server", request_rate, 1)] + ([("server_n1", request_rate, 3)] if load["n"] > 1 else [])
            for label, rate, seed in runs:
                prompts = bm.random_prompts(num_prompts, input_len, vocab, seed=seed)
                run_load = dict(load, n=1) if label == "server_n1" else load
                records, duration = bs.run_load_in_processes(server.url, name, prompts, request_rate=rate,
                                                             **run_load)
                out["results"][label] = summary = bs.summarize(records, duration)
                if label == "server" and half_load:
                    runs.append(("half_load", summary["request_throughput"] / 2, 2))
    finally:
        async_engine.shutdown()
        engine.close()
    if load["n"] > 1:
        out["n_speedup"] = out["results"]["server"]["output_throughput"] / out["results"]["server_n1"]["output_throughput"]
    if baseline:
        single = out["results"]["server_n1" if load["n"] > 1 else "server"]  # the offline run has one choice each
        out["server_vs_offline"] = single["output_throughput"] / out["results"]["offline"]["output_throughput"]
    return out


def _offline_summary(offline: dict, input_tokens: int) -> dict:
    """bench.model's result in bench.serve's keys (the offline run has no ITL or E2EL of its own)."""
    return {"completed": offline["requests"], "failed": 0, "disconnected": 0, "status_5xx": 0,
            "duration_s": offline["seconds"], "total_input_tokens": input_tokens,
            "total_output_tokens": offline["output_tokens"],
            "request_throughput": offline["requests"] / offline["seconds"],
            "output_throughput": offline["output_tokens_per_s"],
            "total_token_throughput": (input_tokens + offline["output_tokens"]) / offline["seconds"],
            "ttft_s": _vllm_stats(offline["ttft_s"]), "tpot_s": _vllm_stats(offline["tpot_s"]),
            "itl_s": _vllm_stats(None), "e2el_s": _vllm_stats(None), "errors": []}


def _vllm_stats(p: dict | None) -> dict:
    """bench.model's percentiles in bench.serve's keys (the offline run has no ITL or E2EL of its own)."""
    if p is None:
        return {k: float("nan") for k in ("mean", "median", "p90", "p99", "std")}
    return {"mean": p["mean"], "median": p["p50"], "p90": p["p90"], "p99": p["p99"], "std": float("nan")}
