"""``anygpu bench model``: run the engine's offline throughput workload (``anygpu.bench.model``) and print/write it."""

from __future__ import annotations

import json
import os

import click
import torch


QUANTIZE_CHOICES = ("nf4", "fp4", "int8", "q4_0", "q4_k", "q8_0")  # models.registry.QUANT_TYPES (a test holds them)
UNQUANTIZED = ("bf16", "none")  # the engine's own dtype: bfloat16 on GPUs, float32 on the CPU (named as it is)


def parse_quantize(text: str | None) -> list[str | None]:
    """``--quantize``: one format or a comma list (``bf16,nf4,int8``) run one after another on the same workload;
    ``bf16`` / ``none`` is the unquantized model.  None (not given): the unquantized model alone."""
    if text is None:
        return [None]
    entries = [item.strip().lower() for item in text.split(",")]
    for item in entries:
        if item not in QUANTIZE_CHOICES + UNQUANTIZED:
            raise click.BadParameter(f"expected a comma list of {', '.join(QUANTIZE_CHOICES)} or bf16 / none "
                                     f"(unquantized), got {item!r} in {text!r}", param_hint="--quantize")
    variants = [None if item in UNQUANTIZED else item for item in entries]
    if len(set(variants)) != len(variants):
        raise click.BadParameter(f"expected each format once, got {text!r}", param_hint="--quantize")
    return variants


def single_quantize(text: str | None) -> str | None:
    """``--quantize`` for suites that run one engine (serve): one format."""
    variants = parse_quantize(text)
    if len(variants) > 1:
        raise click.BadParameter(f"the serve suite runs one model: expected one format, got {text!r}",
                                 param_hint="--quantize")
    return variants[0]


def dtype_label(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _runs_packed_gguf(engine) -> bool:
    """Whether the engine's projections are the GGUF file's packed blocks (the CPU default for Q4_0/Q4_1/Q8_0),
    so the table does not call a model "float32" whose matmuls read 4-bit weights."""
    from ..nn.linear_gguf import GGUFLinear

    model = getattr(engine, "model", None)
    return model is not None and any(isinstance(m, GGUFLinear) for m in model.modules())


def bench_model(*, json_path, model, random_config, quantize, num_prompts, concurrency, input_len, output_len,
                baseline, tp=1, temperature=0.0, llama_bench=None):
    """Each ``--quantize`` variant's engine in turn (built, warmed up, timed, freed), then transformers' generate on
    the same prompts if the unquantized model is among them, and llama.cpp's ``llama-bench`` if given."""
    from ..bench import model as bm

    variants = parse_quantize(quantize)
    concurrency = concurrency or num_prompts
    if llama_bench is not None:
        _check_llama_bench(llama_bench, random_config, variants, num_prompts, concurrency)
    results, names, base = {}, [], None
    for variant in variants:
        engine = make_engine(model, random_config, variant, concurrency, input_len + output_len, tp)
        config = engine.config
        if llama_bench is not None and variant is None and not str(engine.model_path).endswith(".gguf"):
            engine.close()
            raise click.BadParameter(f"llama-bench reads GGUF files; the model is {engine.model_path}",
                                     param_hint="--llama-bench")
        if input_len + output_len > engine.max_model_len:
            raise click.BadParameter(f"input_len + output_len = {input_len + output_len} is over the context of "
                                     f"{engine.max_model_len}", param_hint="--input-len/--output-len")
        prompts = bm.random_prompts(num_prompts, input_len, config.vocab_size)
        bm.warm_up(engine, input_len, config.vocab_size)
        label = variant or dtype_label(engine.dtype) + (" gguf-packed" if _runs_packed_gguf(engine) else "")
        key = "anygpu" if len(variants) == 1 else f"anygpu {label}"
        results[key] = result = bm.run_engine(engine, prompts, output_len, concurrency, temperature)
        _bandwidth_limit(result, engine, min(concurrency, num_prompts), input_len + output_len / 2)
        names.append(label)
        if variant is None:
            base = (key, engine.dtype, engine.model_path)
        device, model_name, dtype = engine.device, engine.model_name, engine.dtype
        engine.close()
        del engine
        free_device(device)
    quant = ",".join(names) if len(variants) > 1 else (variants[0] or "")
    report = {"model": model_name + (f" ({quant})" if quant else "") + (f" tp={tp}" if tp > 1 else ""),
              "workload": f"{num_prompts} prompts x {input_len} in / {output_len} out, concurrency {concurrency}"
                          + (f", temperature {temperature}" if temperature > 0 else ""),
              "device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads(), "results": results}
    if torch.device(device).type == "cpu":  # CPU results depend on it (the int4 kernel most: AVX-512 or not)
        report["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if base is not None and len(variants) > 1:
        unquantized = results[base[0]]["output_tokens_per_s"]
        report["vs_unquantized"] = {k: r["output_tokens_per_s"] / unquantized for k, r in results.items()}
    if baseline and base is not None:
        key, dtype, path = base
        results[f"transformers {dtype_label(dtype)}" if len(variants) > 1 else "transformers"] = \
            bm.run_transformers(config, path, prompts, output_len, concurrency, dtype, device, temperature)
        ref = list(results.values())[-1]["output_tokens_per_s"]
        report["speedup"] = results[key]["output_tokens_per_s"] / ref
    if llama_bench is not None:
        from ..bench.llama_cpp import run_llama_bench

        try:
            results["llama.cpp"] = run_llama_bench(llama_bench, str(base[2]), output_len, torch.get_num_threads())
        except (RuntimeError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        tpot = results[base[0]]["tpot_s"]
        if tpot:  # one sequence's decode rate against llama-bench's tg rate (which times no prefill)
            report["vs_llama_cpp"] = 1.0 / tpot["p50"] / results["llama.cpp"]["output_tokens_per_s"]
    click.echo(bm.format_report(report))
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    click.echo(f"wrote {json_path}")


def _check_llama_bench(binary, random_config, variants, num_prompts, concurrency) -> None:
    """What ``--llama-bench`` needs, refused before anything runs."""
    from ..bench.llama_cpp import check_binary

    try:
        check_binary(binary)
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("--llama-bench: "), param_hint="--llama-bench") from None
    if random_config:
        raise click.BadParameter("llama-bench reads a GGUF file: give --model FILE.gguf (or none, for the default "
                                 "model), not --random-config", param_hint="--llama-bench")
    if num_prompts != 1 or concurrency != 1:
        raise click.BadParameter(f"llama-bench's tg test decodes one sequence: expected --num-prompts 1, got "
                                 f"{num_prompts} prompts at concurrency {concurrency}", param_hint="--llama-bench")
    if None not in variants:
        raise click.BadParameter("llama-bench runs the file as it is: include the unquantized model (bf16 or "
                                 "none) in --quantize", param_hint="--llama-bench")


def _bandwidth_limit(result: dict, engine, batch: int, context: float) -> None:
    """The step's bytes, the shortest TPOT they allow at the measured copy bandwidth, and the measured share."""
    from ..bench.ceilings import copy_bandwidth
    from ..bench.model import decode_step_bytes

    step = decode_step_bytes(engine, batch, context)
    limit = step / copy_bandwidth(engine.device)
    result.update(decode_step_bytes=step, bandwidth_limit_tpot_s=limit)
    if result["tpot_s"]:
        result["bandwidth_share"] = limit / result["tpot_s"]["p50"]


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
