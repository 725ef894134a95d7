"""``anygpu bench model``: run the engine's offline throughput workload (``anygpu.bench.model``) and print/write it."""

from __future__ import annotations

import json
import os

import click


def bench_model(*, json_path, model, random_config, quantize, num_prompts, concurrency, input_len, output_len,
                baseline, tp=1):
    from ..bench import model as bm

    concurrency = concurrency or num_prompts
    engine = make_engine(model, random_config, quantize, concurrency, input_len + output_len, tp)
    config = engine.config
    if input_len + output_len > engine.max_model_len:
        raise click.BadParameter(f"input_len + output_len = {input_len + output_len} is over the context of "
                                 f"{engine.max_model_len}", param_hint="--input-len/--output-len")
    prompts = bm.random_prompts(num_prompts, input_len, config.vocab_size)
    bm.warm_up(engine, input_len, config.vocab_size)
    results = {"anygpu": bm.run_engine(engine, prompts, output_len, concurrency)}
    report = {"model": engine.model_name + (f" ({quantize})" if quantize else "") + (f" tp={tp}" if tp > 1 else ""),
              "workload": f"{num_prompts} prompts x {input_len} in / {output_len} out, concurrency {concurrency}",
              "device": str(engine.device), "dtype": str(engine.dtype), "results": results}
    if baseline and not quantize:
        dtype, device, path = engine.dtype, engine.device, engine.model_path
        engine.close()
        del engine
        free_device(device)
        results["transformers"] = bm.run_transformers(config, path, prompts, output_len, concurrency, dtype, device)
        report["speedup"] = results["anygpu"]["output_tokens_per_s"] / results["transformers"]["output_tokens_per_s"]
    click.echo(bm.format_report(report))
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    click.echo(f"wrote {json_path}")


def make_engine(model, random_config, quantize, max_num_seqs: int, context: int, tp: int = 1):
    """The engine for a benchmark: a checkpoint, or random weights in a named model's shapes with a context
    just long enough for the workload (the KV cache then holds more sequences)."""
    from ..bench import model as bm
    from ..engine import LLMEngine

    if model and random_config:
        raise click.UsageError("give --model or --random-config, not both")
    try:
        if random_config:
            max_len = min(bm.random_config(random_config).max_position, context + 16)
            return bm.random_engine(random_config, quantize=quantize, max_num_seqs=max_num_seqs,
                                    max_model_len=max_len, tp=tp)
        return LLMEngine(model, quantize=quantize, max_num_seqs=max_num_seqs, tp=tp)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None


def free_device(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
