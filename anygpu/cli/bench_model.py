"""``anygpu bench model``: run the engine's offline throughput workload (``anygpu.bench.model``) and print/write it."""

from __future__ import annotations

import json
import os

import click


def bench_model(*, json_path, model, random_config, quantize, num_prompts, concurrency, input_len, output_len,
                baseline):
    from ..bench import model as bm
    from ..engine import LLMEngine

    if model and random_config:
        raise click.UsageError("give --model or --random-config, not both")
    concurrency = concurrency or num_prompts
    try:
        if random_config:
            config = bm.random_config(random_config)
            engine = LLMEngine(random_config, config=config, quantize=quantize, max_num_seqs=concurrency,
                               max_model_len=min(config.max_position, input_len + output_len + 16))
        else:
            engine = LLMEngine(model, quantize=quantize, max_num_seqs=concurrency)
            config = engine.config
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    if input_len + output_len > engine.max_model_len:
        raise click.BadParameter(f"input_len + output_len = {input_len + output_len} is over the context of "
                                 f"{engine.max_model_len}", param_hint="--input-len/--output-len")
    prompts = bm.random_prompts(num_prompts, input_len, config.vocab_size)
    bm.warm_up(engine, input_len, config.vocab_size)
    results = {"anygpu": bm.run_engine(engine, prompts, output_len, concurrency)}
    report = {"model": engine.model_name + (f" ({quantize})" if quantize else ""),
              "workload": f"{num_prompts} prompts x {input_len} in / {output_len} out, concurrency {concurrency}",
              "device": str(engine.device), "dtype": str(engine.dtype), "results": results}
    if baseline and not quantize:
        dtype, device, path = engine.dtype, engine.device, engine.model_path
        del engine
        _free(device)
        results["transformers"] = bm.run_transformers(config, path, prompts, output_len, concurrency, dtype, device)
        report["speedup"] = results["anygpu"]["output_tokens_per_s"] / results["transformers"]["output_tokens_per_s"]
    click.echo(bm.format_report(report))
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    click.echo(f"wrote {json_path}")


def _free(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
