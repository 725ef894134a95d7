"""Turn the JSON of `anygpu bench SUITE --json PATH` into the markdown table docs/perf/2026-11-30-h200-log.md uses.
Usage: python3 tools/bench_to_markdown.py PATH.json [TITLE]"""

import json
import sys


def table(path: str, title: str | None = None) -> str:
    d = json.load(open(path))
    rows = d["rows"]
    names = []
    for r in rows:
        names += [n for n in r["baselines"] if n not in names]
    peak = (f", {d.get('matmul_peak_dtype') or 'bf16'} matmul peak {d['matmul_peak_flops'] / 1e12:.0f} TFLOP/s"
            if d.get("matmul_peak_flops") else "")
    head = f"`anygpu bench {d['suite']}` ({title or d['backend']['device_name']}, {d['timestamp'][:10]}, torch " \
           f"{d['versions']['torch']}, triton {d['versions']['triton']}) — copy bandwidth " \
           f"{d['copy_bandwidth_Bps'] / 1e12:.2f} TB/s{peak} (measured in the same run)\n\n"
    cols = ["op", "shape", "ours us"] + [f"{n} us" for n in names] + [f"vs {n}" for n in names] + ["achieved"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        ours = r["ours"]
        shape = r["shape"] + (" [graph]" if r.get("timing") == "graph" else "")
        cells = [r["op"], shape, _us(ours)]
        cells += [_us(r["baselines"].get(n)) for n in names]
        cells += [_ratio(r["baselines"].get(n)) for n in names]
        if ours.get("TFLOPs") and (ours.get("matmul_peak_fraction") or 0) > 0.05:
            cells.append(f"{ours['TFLOPs']:.0f} TFLOP/s")
        elif ours.get("copy_bw_fraction") is not None:
            cells.append(f"{100 * ours['copy_bw_fraction']:.0f}% BW")
        else:
            cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def _us(t) -> str:
    return "-" if not t or t.get("ms") is None else f"{1000 * t['ms']:.1f}"


def _ratio(t) -> str:
    return "-" if not t or t.get("ratio") is None else f"{t['ratio']:.2f}x"


if __name__ == "__main__":
    print(table(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
