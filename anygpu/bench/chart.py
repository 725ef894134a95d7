"""The PNG chart of a ``Report``: per case, a bar for ours and one for each baseline.

Imports matplotlib at module level, so importing this module fails without it (``write_png`` checks).
Uses the Agg canvas directly, not pyplot: no global backend switch, no window, safe on a headless node.
"""

from __future__ import annotations

import math

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def draw(report) -> Figure:
    rows = report.rows
    names = ["ours", *report.baseline_names()]
    # The fraction of copy bandwidth compares across cases (higher is better, 100% is the copy), but only
    # when every case counts its bytes; otherwise milliseconds, which every case has.
    by_bandwidth = bool(rows) and all(row["bytes"] for row in rows)
    metric = "copy_bw_fraction" if by_bandwidth else "ms"
    scale = 100.0 if by_bandwidth else 1.0

    fig = Figure(figsize=(max(6.0, 1.1 * len(rows) * len(names) ** 0.5 + 2), 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(names)
    positions = range(len(rows))
    for i, name in enumerate(names):
        values = [_value(row, name, metric) * scale for row in rows]
        ax.bar([p - 0.4 + (i + 0.5) * width for p in positions], values, width, label=name)
    ax.set_xticks(list(positions), [f"{row['op']}\n{row['shape']}" for row in rows], fontsize=8)
    if by_bandwidth:
        ax.axhline(100.0, color="gray", linestyle="--", linewidth=1)
        ax.set_ylabel("% of copy bandwidth (higher is better)")
    else:
        ax.set_ylabel("ms (lower is better)")
    ax.set_title(report.header(), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _value(row: dict, name: str, metric: str) -> float:
    entry = row["ours"] if name == "ours" else row["baselines"].get(name, {})
    value = entry.get(metric)
    return math.nan if value is None else value  # a missing or failed baseline draws no bar
