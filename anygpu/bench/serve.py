"""``anygpu bench serve``: load an OpenAI-compatible server and report vLLM's serving metrics.

Each request is a streaming ``/v1/completions`` call with a prompt of token ids, ``max_tokens = output_len``,
greedy, ``ignore_eos`` (vLLM's extension, so every request generates exactly ``output_len`` tokens) and
``stream_options.include_usage`` (the token count comes from the server's usage, not from counting chunks).
Arrivals: at most ``concurrency`` in flight; with ``request_rate`` they also arrive as a Poisson process.
``disconnect_fraction`` of the requests (seeded choice) close their stream after a few chunks, as a client
that goes away would; they are counted apart and left out of the latency metrics.

Metrics, as vLLM's ``benchmark_serving.calculate_metrics`` defines them:
- TTFT: request sent -> first chunk with text;  E2EL: request sent -> last byte;
- TPOT per request: (E2EL - TTFT) / (output tokens - 1), requests with more than one token;
- ITL: every gap between consecutive chunks with text, pooled over requests;
- throughput: completed requests, output tokens and input + output tokens, each per second of the run.

The client runs in ``client_procs`` child processes (each with its own event loop and connection pool) so the
load generator's own Python does not share a GIL with the server it measures.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import random
import statistics
import time

import httpx


def _stats(values: list[float]) -> dict:
    if not values:
        return {k: float("nan") for k in ("mean", "median", "p90", "p99", "std")}
    ordered = sorted(values)

    def pick(q):
        return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)]

    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p90": pick(0.9),
            "p99": pick(0.99), "std": statistics.pstdev(values)}


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt, output_len: int,
                      disconnect_after: int | None = None, headers: dict | None = None, n: int = 1) -> dict:
    """One streamed completion (``n`` choices: its output tokens are every choice's, the server's usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if n > 1:
        body["n"] = n
    record = {"ok": False, "status": None, "disconnected": False, "ttft": None, "itl": [], "latency": None,
              "output_tokens": 0, "prompt_tokens": len(prompt) if isinstance(prompt, list) else None, "error": None}
    start = last = time.monotonic()
    chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                record["error"] = (await response.aread()).decode(errors="replace")[:500]
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record["error"] = event["error"].get("message")
                    return record
                if event.get("usage"):
                    record["output_tokens"] = event["usage"]["completion_tokens"]
                    record["prompt_tokens"] = event["usage"]["prompt_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    now = time.monotonic()
                    if record["ttft"] is None:
                        record["ttft"] = now - start
                    else:
                        record["itl"].append(now - last)
                    last = now
                    chunks += 1
                    if disconnect_after is not None and chunks >= disconnect_after:
                        record["disconnected"] = True
                        return record  # leaving the block closes the connection mid-stream
        record["latency"] = time.monotonic() - start
        if record["ttft"] is None:
            record["error"] = "the stream ended without any text"
        record["ok"] = record["error"] is None
    except httpx.HTTPError as error:
        record["error"] = f"{type(error).__name__}: {error}"
    return record


async def run_load(url: str, model: str, prompts: list, output_len: int, concurrency: int,
                   request_rate: float = math.inf, disconnect_fraction: float = 0.0, seed: int = 0,
                   api_key: str | None = None, n: int = 1) -> tuple[list[dict], float, float]:
    """Send every prompt; returns (records in prompt order, start, end) on the monotonic clock."""
    rng = random.Random(seed)
    plan = [rng.randint(1, max(1, output_len // 2)) if rng.random() < disconnect_fraction else None
            for _ in prompts]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    records: list[dict | None] = [None] * len(prompts)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        async def go(i):
            async with gate:
                records[i] = await one_request(client, url, model, prompts[i], output_len, plan[i], headers, n)

        start = time.monotonic()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(go(i)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        end = time.monotonic()
    return records, start, end


def _client_main(args, results, barrier) -> None:
    barrier.wait()  # every process imported and ready: start together, or the run's duration would include imports
    results.put(asyncio.run(run_load(*args)))


def run_load_in_processes(url: str, model: str, prompts: list, output_len: int, concurrency: int,
                          request_rate: float = math.inf, disconnect_fraction: float = 0.0, client_procs: int = 1,
                          api_key: str | None = None, n: int = 1) -> tuple[list[dict], float]:
    """``run_load`` split over ``client_procs`` processes (prompts dealt round-robin, concurrency and rate
    divided); returns all records and the wall time from the first send to the last answer."""
    procs = max(1, min(client_procs, concurrency, len(prompts)))
    if procs == 1:
        records, start, end = asyncio.run(run_load(url, model, prompts, output_len, concurrency, request_rate,
                                                   disconnect_fraction, 0, api_key, n))
        return records, end - start
    ctx = multiprocessing.get_context("spawn")
    results, barrier = ctx.Queue(), ctx.Barrier(procs)
    workers = []
    for p in range(procs):
        share = concurrency // procs + (1 if p < concurrency % procs else 0)
        args = (url, model, prompts[p::procs], output_len, share, request_rate / procs, disconnect_fraction, p,
                api_key, n)
        workers.append(ctx.Process(target=_client_main, args=(args, results, barrier), daemon=True))
    for w in workers:
        w.start()
    parts = [results.get() for _ in workers]
    for w in workers:
        w.join()
    records = [r for part in parts for r in part[0]]
    return records, max(p[2] for p in parts) - min(p[1] for p in parts)


def summarize(records: list[dict], duration: float) -> dict:
    done = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"] and not r["disconnected"]]
    out_tokens = sum(r["output_tokens"] for r in done)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in done)
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in done if r["output_tokens"] > 1]
    return {
        "completed": len(done), "failed": len(failed), "disconnected": sum(r["disconnected"] for r in records),
        "status_5xx": sum(1 for r in records if (r["status"] or 0) >= 500),
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": _stats([r["ttft"] for r in done if r["ttft"] is not None]), "tpot_s": _stats(tpot),
        "itl_s": _stats([g for r in done for g in r["itl"]]), "e2el_s": _stats([r["latency"] for r in done]),
        "errors": sorted({r["error"] for r in failed if r["error"]})[:5],
    }


def format_summary(name: str, s: dict) -> str:
    def ms(d):
        return f"{d['mean'] * 1e3:.1f} / {d['median'] * 1e3:.1f} / {d['p90'] * 1e3:.1f} / {d['p99'] * 1e3:.1f}"

    lines = [f"== {name}",
             f"completed {s['completed']}  failed {s['failed']}  disconnected {s['disconnected']}  5xx {s['status_5xx']}"
             f"  duration {s['duration_s']:.2f} s",
             f"requests/s {s['request_throughput']:.2f}  output tok/s {s['output_throughput']:.1f}  "
             f"total tok/s {s['total_token_throughput']:.1f}",
             f"TTFT ms mean/median/p90/p99  {ms(s['ttft_s'])}",
             f"TPOT ms mean/median/p90/p99  {ms(s['tpot_s'])}",
             f"ITL  ms mean/median/p90/p99  {ms(s['itl_s'])}",
             f"E2EL ms mean/median/p90/p99  {ms(s['e2el_s'])}"]
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    return "\n".join(lines)
