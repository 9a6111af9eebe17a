"""Fig. 1: the recovery factor against test accuracy, one point per cell (PNG)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from fedmask_app.report.protocol import protocol_note
from fedmask_app.report.runs import bs_order


def decomposition_curve(r, k):
    """The signal-noise decomposition's recovery factor (K_c r + 1) / (r + 1), r = ‖μ‖²/σ²."""
    r = np.asarray(r, dtype=float)
    return (k * r + 1.0) / (r + 1.0)


def log_recovery_axis(ax, low: float, high: float) -> None:
    """A log-scale y axis from ``low`` to ``high`` with recovery factors as plain numbers (1, 1.5, 2, ...)."""
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    ticks = [t for t in (0.1, 0.2, 0.5, 1, 1.5, 2, 3, 5, 7, 10, 15, 20, 30, 50, 100) if low <= t <= high]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def fig1(cells: pd.DataFrame, path: str | Path | None = None):
    """Fig. 1: per cell, recovery factor 1/ΔS (y) against test accuracy (x); marker by batch size,
    τ written next to each point, the ceiling K_c as a line. Saved as PNG to ``path`` if given."""

    fig = Figure(figsize=(8.5, 5.2), layout="constrained")
    ax = fig.add_subplot()
    shown = cells.dropna(subset=["recovery", "test_accuracy"])
    bs_values = sorted(cells["bs"].unique(), key=bs_order)
    alphas = sorted(cells["alpha"].unique(), reverse=True)
    colour_by_alpha = len(alphas) > 1
    palette = [f"C{i}" for i in range(10)]
    labels = []
    for i, bs in enumerate(bs_values):
        for j, alpha in enumerate(alphas):
            part = shown[(shown["bs"] == bs) & (shown["alpha"] == alpha)]
            if part.empty:
                continue
            label = f"bs = {bs}" + (f", α = {alpha:g}" if colour_by_alpha else "")
            ax.scatter(100 * part["test_accuracy"], part["recovery"], marker=_MARKERS[i % len(_MARKERS)], s=60,
                       color=palette[(j if colour_by_alpha else i) % 10], edgecolor="black", linewidth=0.5,
                       label=label, zorder=3)
            labels += [(100 * row["test_accuracy"], row["recovery"],
                        f"τ={row['tau']}" + ("*" if row.get("n_incomplete", 0) else "")) for _, row in part.iterrows()]
    ceilings = sorted(pd.to_numeric(cells["K_c"], errors="coerce").dropna().unique())
    for k in ceilings:  # no point lies above its ceiling, so the label above the line hides none
        ax.axhline(k, color="black", linestyle="--", linewidth=1, zorder=1)
        ax.annotate(f"ceiling $K_c$ = {k:g} (all updates equal)", (0.99, k), xycoords=("axes fraction", "data"),
                    textcoords="offset points", xytext=(0, 4), fontsize=9, ha="right")
    ax.axhline(1, color="grey", linestyle=":", linewidth=1, zorder=1)
    ax.annotate("1 = no more than independent masks", (0.99, 1), xycoords=("axes fraction", "data"),
                textcoords="offset points", xytext=(0, -11), fontsize=8, color="grey", ha="right")
    values = shown["recovery"][shown["recovery"] > 0]
    top = max([*ceilings, *values, 1.0])
    bottom = min([*values, 1.0])
    if top / bottom >= 5:
        log_recovery_axis(ax, bottom / 1.5, top * 1.6)
    else:
        ax.set_ylim(0, top * 1.15)
    ax.margins(x=0.15)
    ax.set_xlabel("test accuracy (%)")
    ax.set_ylabel("recovery factor 1/ΔS = R_shr / R_ind")
    if len(shown):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, title="marker: batch size\nlabel: τ",
                  title_fontsize=9)
    seeds = sorted(cells["n_seeds"].unique())
    seed_text = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    lines = [
        "Recovery factor vs test accuracy (Fig. 1)",
        f"per run: median of the last {int(cells['window'].iloc[0])} rounds; per cell: median over {seed_text} seed(s)",
        textwrap.fill(protocol_note(cells), 95),
    ]
    if cells.get("n_incomplete", pd.Series([0])).sum():
        lines.append("* cell includes incomplete runs")
    dropped = len(cells) - len(shown)
    if dropped:
        lines.append(f"{dropped} cell(s) without recovery or test accuracy not shown")
    ax.set_title("\n".join(lines), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    _place_labels(ax, labels, hlines=[*ceilings, 1.0])
    if path is not None:
        fig.savefig(path, dpi=130)
    return fig


def _place_labels(ax, items: list[tuple[float, float, str]], hlines: Sequence[float] = (), fontsize: float = 9) -> None:
    """Write each (x, y, text) next to its point, on the first side where it covers no marker, no
    horizontal line at ``hlines`` and no label placed before (greedy; text extents estimated from the
    font size)."""
    FigureCanvasAgg(ax.figure).draw()  # settle the layout, so that data -> pixel positions are final
    scale = ax.figure.dpi / 72
    pixels = [ax.transData.transform((x, y)) for x, y, _ in items]
    radius = 5 * scale
    taken = [(px - radius, py - radius, px + radius, py + radius) for px, py in pixels]
    for y in hlines:
        line = ax.transData.transform((0, y))[1]
        taken.append((-math.inf, line - scale, math.inf, line + scale))
    sides = ((6, 3), (6, -13), (-6, 3), (-6, -13), (6, 13), (-6, 13), (6, -23), (-6, -23), (12, -5), (-12, -5))
    for (x, y, text), (px, py) in zip(items, pixels, strict=True):
        width, height = (len(text) * 0.7 * fontsize + 3) * scale, 1.25 * fontsize * scale
        best = None
        for dx, dy in sides:
            x0 = px + dx * scale - (width if dx < 0 else 0)
            box = (x0, py + dy * scale, x0 + width, py + dy * scale + height)
            clash = sum(max(0.0, min(box[2], t[2]) - max(box[0], t[0]))
                        * max(0.0, min(box[3], t[3]) - max(box[1], t[1])) for t in taken)
            if best is None or clash < best[0]:
                best = (clash, dx, dy, box)
            if clash == 0:
                break
        _, dx, dy, box = best
        taken.append(box)
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=fontsize,
                    ha="right" if dx < 0 else "left", va="bottom")
