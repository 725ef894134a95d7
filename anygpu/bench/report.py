"""A suite's results: a table for the terminal, JSON for keeping and comparing, a PNG chart.

Each row is a dict (the JSON shape):

    {"op", "shape", "bytes", "flops", "timing": "eager" | "graph" (CUDA/HIP graph replays),
     "ours": {"ms", "GBps", "TFLOPs", "copy_bw_fraction", "matmul_peak_fraction"},
     "baselines": {name: {same keys, "ratio": baseline ms / ours ms} or {"error": "..."}}}

A ratio above 1 means ours is faster.  Fractions are of the copy bandwidth and matmul peak measured in
the same run (``ceilings.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tabulate import tabulate


@dataclass
class Report:
    suite: str
    backend: dict  # name, device, device_name, arch, summary
    versions: dict
    timestamp: str  # ISO 8601, UTC
    copy_bandwidth_Bps: float  # bytes read + written per second by dst.copy_(src), measured in this run
    matmul_peak_flops: float | None  # None when no case counts FLOPs (not measured)
    rows: list[dict] = field(default_factory=list)
    quick: bool = False
    matmul_peak_dtype: str | None = None

    # ---- terminal ----------------------------------------------------------------------------------

    def baseline_names(self) -> list[str]:
        """Every baseline any row has, in the order they first appear."""
        return list(dict.fromkeys(name for row in self.rows for name in row["baselines"]))

    def header(self) -> str:
        peak = (f"matmul peak {self.matmul_peak_flops / 1e12:.4g} TFLOP/s ({self.matmul_peak_dtype})"
                if self.matmul_peak_flops else "matmul peak not measured (no case counts FLOPs)")
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items() if k in ("torch", "triton"))
        return (f"{self.suite}{' (quick)' if self.quick else ''} on {self.backend['summary']} [{versions}]\n"
                f"measured in this run: copy bandwidth {format_bandwidth(self.copy_bandwidth_Bps)}, {peak}")

    def table(self) -> str:
        names = self.baseline_names()
        any_bytes = any(row["bytes"] for row in self.rows)
        any_flops = any(row["flops"] for row in self.rows)
        headers = ["op", "shape", "ours ms", *(f"{n} ms" for n in names), *(f"vs {n}" for n in names)]
        headers += ["GB/s", "% copy BW"] if any_bytes else []
        headers += ["TFLOP/s", "% matmul peak"] if any_flops else []
        body = []
        for row in self.rows:
            ours, base = row["ours"], row["baselines"]
            shape = row["shape"] + (" [graph]" if row.get("timing") == "graph" else "")
            cells = [row["op"], shape, _ms(ours["ms"])]
            cells += ["error" if "error" in base.get(n, {}) else _ms(base.get(n, {}).get("ms")) for n in names]
            cells += [_fmt(base.get(n, {}).get("ratio"), "{:.2f}x") for n in names]
            if any_bytes:
                cells += [_fmt(ours["GBps"], "{:.1f}"), _fmt(ours["copy_bw_fraction"], "{:.1%}")]
            if any_flops:
                cells += [_fmt(ours["TFLOPs"], "{:.4g}"), _fmt(ours["matmul_peak_fraction"], "{:.1%}")]
            body.append(cells)
        # disable_numparse: keep our formatting ("1.23x", "0.0123") rather than tabulate's.
        text = tabulate(body, headers=headers, disable_numparse=True,
                        colalign=("left", "left") + ("right",) * (len(headers) - 2))
        errors = [f"  {n} on {row['op']} {row['shape']}: {e['error']}"
                  for row in self.rows for n, e in row["baselines"].items() if "error" in e]
        footer = ("\n\nbaselines that failed:\n" + "\n".join(errors)) if errors else ""
        if any(row.get("timing") == "graph" for row in self.rows):
            footer += ("\n\n[graph]: timed as CUDA/HIP graph replays (host launch cost excluded), as a decode step "
                       "runs them")
        return f"{self.header()}\n\n{text}{footer}"

    def __str__(self) -> str:
        return self.table()

    # ---- files -------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Report:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def write_json(self, path) -> Path:
        """Write ``to_json()`` to ``path`` atomically: a reader sees the old file or the whole new one."""
        text = json.dumps(self.to_json(), indent=2) + "\n"
        return _atomic_write(path, lambda f: f.write(text.encode()))

    def write_png(self, path) -> bool:
        """A bar chart per case, ours against each baseline.  False (and nothing written) without matplotlib."""
        try:
            from .chart import draw
        except ImportError:
            return False
        fig = draw(self)
        _atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
        return True


def format_bandwidth(bytes_per_s: float) -> str:
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.2f} TB/s"
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def _fmt(value, spec: str) -> str:
    return "" if value is None else spec.format(value)


def _ms(ms) -> str:
    if ms is None:
        return ""
    return f"{ms:.4g}" if ms < 1000 else f"{ms:.0f}"


def _atomic_write(path, write) -> Path:
    # A temp file in the same directory, so os.replace is a rename within one filesystem (atomic).
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are for sharing
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
