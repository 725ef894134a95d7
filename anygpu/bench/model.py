"""``anygpu bench model``: offline serving throughput of the engine, and transformers' ``generate`` as the baseline.

Workload: ``num_prompts`` random prompts of ``input_len`` token ids (seeded), each generating exactly
``output_len`` tokens (greedy, EOS ignored), at most ``concurrency`` in flight (a new one starts when one ends).
Metrics (vLLM's definitions): output tokens/s = all generated tokens / wall time; TTFT = first token time -
arrival; TPOT = (finish - first token) / (output tokens - 1) per request; ITL = the gap before each token after a
request's first (its p50 is the steady decode step: TPOT also carries the prefill steps that stall a request's
decoding when many arrive at once); percentiles p50/p90/p99.

Bandwidth limit: a decode step must read every weight once (the input embedding only for its looked-up rows,
unless the output head shares it) and each running sequence's KV cache; that many bytes at the device's measured
copy bandwidth is the shortest step the memory allows.  ``decode_step_bytes`` counts them for the workload's
batch at its mean decode context (input + output / 2), and the report sets that shortest step against the
measured TPOT p50 (``bandwidth_share``).

Baseline (``baseline=True``): transformers' ``LlamaForCausalLM.generate`` on the same shapes, dtype and device,
batches of ``concurrency`` prompts (static batching: a batch ends when its longest member does), with
``min_new_tokens = max_new_tokens = output_len``.  For a checkpoint it loads the same file (GGUF through
transformers' own loader); for ``--random-config`` it builds the model from the equivalent ``LlamaConfig`` with
its own random weights (speed does not depend on the values).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import torch

from ..engine import LLMEngine, SamplingParams
from ..models import ModelConfig
from ..models.tokenizer import Tokenizer
from ..quant.state import QuantState

# Real shapes for benchmarks without a download (random weights).
RANDOM_CONFIGS = {
    "llama3-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                      rope_theta=500000.0, rope_scaling=None, max_position=8192, tie_word_embeddings=False,
                      attention_bias=False, sliding_window=None, bos_token_id=128000, eos_token_ids=(128001,),
                      dtype=torch.bfloat16),
    "tiny": dict(architecture="llama", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                 max_position=2048, tie_word_embeddings=False, attention_bias=False, sliding_window=None,
                 bos_token_id=1, eos_token_ids=(2,), dtype=None),
}


def random_config(name: str) -> ModelConfig:
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"random_config: expected one of {sorted(RANDOM_CONFIGS)}, got {name!r}")
    return ModelConfig(**RANDOM_CONFIGS[name])


def random_engine(name: str, **engine_kwargs) -> LLMEngine:
    """An engine with random weights in the named shapes and a synthetic word-per-id tokenizer (so a server
    streams real text and pays for detokenization as it would with a checkpoint)."""
    config = random_config(name)
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    return LLMEngine(name, config=config, tokenizer=Tokenizer.synthetic(config.vocab_size, eos), **engine_kwargs)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    ordered = sorted(values)

    def pick(q):
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(values)}


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the lowest ids: models put their special tokens there.
    low = min(100, vocab // 2)
    return torch.randint(low, vocab, (num, length), generator=gen).tolist()


def warm_up(engine: LLMEngine, input_len: int, vocab: int) -> None:
    """Compile every kernel specialization the workload will meet before timing it: a plain prefill, a step
    mixing a decode with a prefill (paged_prefill), and decodes.  Prompts not in the workload (a shared
    prompt would make the timed run's first step a prefix-cache hit)."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    a, b = random_prompts(2, input_len, vocab, seed=12345)
    engine.add_request("warmup-a", a, params)
    engine.step()
    engine.add_request("warmup-b", b, params)
    while engine.has_unfinished():
        engine.step()


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int, concurrency: int,
               temperature: float = 0.0) -> dict:
    """Every prompt to ``output_len`` tokens (EOS ignored), at most ``concurrency`` in flight; greedy, or sampled
    at ``temperature`` (vLLM's throughput benchmark samples at 1.0)."""
    params = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight, done = 0, []
    last: dict[str, tuple[float, int]] = {}  # request -> (when its latest tokens came, how many it had then)
    itl = []  # inter-token latencies: the gap before each token after the first (vLLM's ITL)
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"bench-{i}", prompt, params)
            in_flight += 1
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            count = len(out.token_ids)
            seen = last.get(out.request_id)
            if seen is not None and count > seen[1]:
                itl += [(now - seen[0]) / (count - seen[1])] * (count - seen[1])
            last[out.request_id] = (now, count)
            if out.finished:
                in_flight -= 1
                done.append(out)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in done)
    ttft = [o.first_token_time - o.arrival_time for o in done]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in done if len(o.token_ids) > 1]
    return {"requests": len(done), "output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed,
            "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "itl_s": percentiles(itl)}


def run_transformers(config: ModelConfig, model_path, prompts: list[list[int]], output_len: int, concurrency: int,
                     dtype: torch.dtype, device: torch.device, temperature: float = 0.0) -> dict:
    import transformers

    if model_path is None:
        hf_cfg = transformers.LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
            rope_theta=config.rope_theta, max_position_embeddings=config.max_position,
            tie_word_embeddings=config.tie_word_embeddings)
        with torch.device(device):
            torch.set_default_dtype(dtype)
            try:
                model = transformers.LlamaForCausalLM(hf_cfg)
            finally:
                torch.set_default_dtype(torch.float32)
    else:
        path = str(model_path)
        kwargs = {"gguf_file": path.rsplit("/", 1)[1]} if path.endswith(".gguf") else {}
        folder = path.rsplit("/", 1)[0] if kwargs else path
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(device)
    model.eval()
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        ids = torch.tensor(prompts[i:i + concurrency], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, pad_token_id=0,
                                 **({"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0
                                    else {"do_sample": False}))
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed}


def _held(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors a weight carries beside its data: ``SCB``, a QuantState's absmax/code (and its nested state)."""
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, QuantState) and depth < 2:
            yield from _held(value, depth + 1)


def _weight_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for m in module.modules():
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is None:
                continue
            for u in (t, *_held(t)):
                key = (u.device, u.untyped_storage().data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += u.untyped_storage().nbytes()
    return total


def decode_step_bytes(engine: LLMEngine, batch: int, context: float) -> float:
    """Bytes one decode step of ``batch`` sequences at ``context`` tokens each must read (this rank's share)."""
    model = engine.model
    total = _weight_bytes(model)
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is not None and getattr(head, "weight", None) is not getattr(embed, "weight", None):
        total -= _weight_bytes(embed)  # only the batch's rows are looked up
    cache = engine.runner.kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
    per_token = 2 * cache.shape[1] * cache.shape[4] * cache.shape[5] * cache.element_size()
    return total + batch * context * per_token


def _ms(p: dict | None, digits: int) -> str:
    """Percentiles in seconds as "p50 / p90 / p99" milliseconds; "-" where the engine has none."""
    return "-" if not p else " / ".join(f"{p[q] * 1e3:.{digits}f}" for q in ("p50", "p90", "p99"))


def format_report(report: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name, r in report["results"].items():
        rows.append([name, r["requests"], r["output_tokens"], f"{r['seconds']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                     _ms(r.get("ttft_s"), 1), _ms(r.get("tpot_s"), 2), _ms(r.get("itl_s"), 2),
                     f"{100 * r['bandwidth_share']:.0f} %" if r.get("bandwidth_share") else "-"])
    where = report["device"]
    if report.get("cpu_capability"):
        threads = report.get("threads", 0)
        where += f" ({report['cpu_capability']}, {threads} thread{'' if threads == 1 else 's'})"
    head = f"{report['model']}  {report['workload']}  on {where}\n"
    table = tabulate(rows, ["engine", "requests", "out tokens", "s", "out tok/s", "TTFT ms p50/p90/p99",
                            "TPOT ms p50/p90/p99", "ITL ms p50/p90/p99", "of BW limit"])
    ratio = report.get("speedup")
    lines = [f"\nanygpu / transformers output tokens/s: {ratio:.2f}x"] if ratio else []
    llama = report.get("vs_llama_cpp")
    if llama:
        lines.append(f"\nanygpu / llama.cpp decode tokens/s (1 / TPOT p50 against llama-bench's tg): {llama:.2f}x")
    versus = report.get("vs_unquantized")
    if versus:
        lines.append("\nvs the unquantized engine, output tokens/s: "
                     + ", ".join(f"{name.removeprefix('anygpu ')} {r:.2f}x" for name, r in versus.items()))
    return head + table + "".join(lines)
