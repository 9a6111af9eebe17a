"""Reading results the way the paper does (PAPER.md, "The measurement protocol").

* ``load_runs(dirs)``: every run folder (``rounds.csv`` + ``config.json``) under the given folders,
  as one DataFrame of per-round rows with the run's config columns (kebab-case run-config keys)
  beside them.
* ``run_summary(rounds, window)``: one row per run, each statistic's median over the run's last
  ``window`` rounds (rounds num-rounds - window + 1 .. num-rounds that are present).
* ``cell_summary(runs)``: one row per cell (a configuration, i.e. every run-config key that can
  change the measurement, seed excepted), the median of its runs' values across seeds.
* ``fig1(cells, path)``: the recovery factor against test accuracy, one point per cell.

T, the number of local SGD steps per round (PAPER.md: "T = tau * ceil(n_k / bs)"): shards differ
in size, so T is shown for the *mean shard* of the cohorts in the window: n_k = mean over the
window rounds of num_examples / num_clients (rounds.csv), averaged over the cell's runs; then
T = tau for bs = "full", else tau * ceil(n_k / bs). A given client's count is tau * ceil(n_k / bs)
with its own n_k.

Pure pandas/matplotlib: importing this module does not import torch, so the notebook and
``fedmask-report`` start fast.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from fedmask_app.run.schema import CONFIG_FILE, ROUND_COLUMNS, ROUNDS_FILE

# The statistics the paper reports per configuration (median over the window, then over seeds).
METRICS = ("recovery", "recovery_weighted", "mu2_hat", "sigma2_hat", "test_accuracy")
REPORTED = (*METRICS, "pct_below_1")
# The paper's table keys: batch size, local epochs, Dirichlet concentration.
KEYS = ("bs", "tau", "alpha")
# Columns load_runs adds to the per-round rows besides rounds.csv's and the run-config keys.
META_COLUMNS = ("run", "run_name", "bs", "tau", "K_c")
# Run-config keys that do not define a cell: the seed (the cell's median runs across it) and the
# keys that only say where or how a run executes, not what it measures.
NOT_CELL_KEYS = frozenset({
    "seed", "run-name", "output-dir", "resume", "data-dir", "device", "threads", "checkpoint-every",
    "eval-batch-size", "eval-every", "round-timeout", "min-clients",
})
PAPER_ROUNDS, PAPER_WINDOW = 200, 50
# Columns run_summary and cell_summary compute (everything else in their frames is a run-config key).
_DERIVED = frozenset({
    *META_COLUMNS, *REPORTED, "num_rounds", "rounds_completed", "last_round", "complete", "window", "window_start",
    "window_rounds", "mean_shard", "T", "cell_id", "cell", "n_k", "n_seeds", "n_runs", "n_incomplete", "bs", "tau",
    "alpha",
})


class SummaryError(ValueError):
    """Results or a reference table that cannot be read; the message names the file."""


# ---------------------------------------------------------------------------------------------
# Loading


def find_run_dirs(dirs: Iterable[str | Path]) -> list[Path]:
    """Run folders (holding rounds.csv and config.json): each dir itself, or any folder below it."""
    found: dict[Path, None] = {}
    for d in map(Path, dirs):
        if not d.is_dir():
            raise SummaryError(f"{d} is not a folder")
        if (d / ROUNDS_FILE).is_file() and (d / CONFIG_FILE).is_file():
            found.setdefault(d.resolve())
            continue
        for rounds in sorted(d.rglob(ROUNDS_FILE)):
            if (rounds.parent / CONFIG_FILE).is_file():
                found.setdefault(rounds.parent.resolve())
    return list(found)


def _read_rounds(path: Path) -> pd.DataFrame:
    text = path.read_text()
    if text and not text.endswith("\n"):  # a row being written right now (live sweep): not yet a row
        text = text[: text.rfind("\n") + 1]
    if not text.strip():
        raise SummaryError(f"{path} is empty (no header)")
    frame = pd.read_csv(io.StringIO(text), dtype={"cohort": str})
    missing = [c for c in ("round", *METRICS, "num_clients", "num_examples") if c not in frame.columns]
    if missing:
        raise SummaryError(f"{path} lacks column(s) {', '.join(missing)}")
    for column in frame.columns:
        if column != "cohort":
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
    frame = frame.dropna(subset=["round"]).astype({"round": int})
    return frame.drop_duplicates("round", keep="last").sort_values("round", ignore_index=True)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())["run_config"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SummaryError(f"{path} is not a run's config.json (no 'run_config' mapping): {exc}") from exc
    if not isinstance(config, dict) or "num-rounds" not in config:
        raise SummaryError(f"{path}: run_config lacks 'num-rounds'")
    return config


def bs_label(value) -> str:
    """Batch size as the paper writes it: "32", "128", "full"."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip().lower() if isinstance(value, str) else str(value)


def bs_order(label: str) -> tuple[int, float, str]:
    """Sort key: numeric batch sizes ascending, then "full"."""
    try:
        return 0, float(label), ""
    except ValueError:
        return 1, math.inf, label


def load_runs(dirs: Iterable[str | Path]) -> pd.DataFrame:
    """Per-round rows of every run under ``dirs``, with the run-config keys as columns.

    Extra columns: ``run`` (the run folder), ``run_name`` (its name), ``bs`` ("32", "full"),
    ``tau`` (local epochs) and ``K_c`` (clients per round). A run without any round yet gives one
    row with ``round`` NaN, so it is still counted (as incomplete). Folders that cannot be read are
    skipped with a warning; none at all raises SummaryError.
    """
    frames = []
    run_dirs = find_run_dirs(dirs)
    for run_dir in run_dirs:
        try:
            config = _read_config(run_dir / CONFIG_FILE)
            rounds = _read_rounds(run_dir / ROUNDS_FILE)
        except (SummaryError, OSError, pd.errors.ParserError) as exc:
            warnings.warn(f"skipping {run_dir}: {exc}", stacklevel=2)
            continue
        if rounds.empty:
            rounds = pd.DataFrame({c: [np.nan] for c in ROUND_COLUMNS})
        meta = {
            "run": str(run_dir), "run_name": run_dir.name, "bs": bs_label(config.get("batch-size")),
            "tau": config.get("local-epochs"), "K_c": config.get("clients-per-round"),
        }
        extra = {**{k: v for k, v in config.items() if k not in rounds.columns}, **meta}
        frames.append(rounds.assign(**{k: [v] * len(rounds) for k, v in extra.items()}))
    if not frames:
        where = ", ".join(map(str, dirs))
        raise SummaryError(f"no runs (folders with {ROUNDS_FILE} and {CONFIG_FILE}) under {where}")
    return pd.concat(frames, ignore_index=True)


def config_keys(rounds: pd.DataFrame) -> list[str]:
    """The run-config columns of a load_runs frame."""
    return [c for c in rounds.columns if c not in ROUND_COLUMNS and c not in META_COLUMNS]


# ---------------------------------------------------------------------------------------------
# Per run and per cell


def local_steps(tau, bs: str, n_k: float) -> float:
    """T: tau for full batch, else tau * ceil(n_k / bs) (PAPER.md); NaN when n_k is unknown."""
    if bs == "full":
        return float(tau)
    if n_k is None or not np.isfinite(n_k) or bs_order(bs)[0] != 0:
        return float("nan")
    return float(tau * math.ceil(n_k / float(bs)))


def _cell_id(config: dict) -> str:
    return json.dumps({k: config[k] for k in sorted(config) if k not in NOT_CELL_KEYS}, sort_keys=True, default=str)


def run_summary(rounds: pd.DataFrame, window: int = PAPER_WINDOW) -> pd.DataFrame:
    """One row per run: its config, rounds completed, and the window medians.

    The window is rounds max(1, num-rounds - window + 1) .. num-rounds; its rounds that are present
    count (an incomplete run may have fewer, or none: then the medians are NaN). NaN cells are
    skipped (test_accuracy when eval-every > 1). pct_below_1 is the share (%) of the window rounds
    with a recovery value that have recovery < 1. mean_shard is n_k of the module docstring.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    keys = config_keys(rounds)
    out = []
    for run, group in rounds.groupby("run", sort=False):
        first = group.iloc[0]
        config = {k: first[k] for k in keys if not _missing(first[k])}
        num_rounds = int(config["num-rounds"])
        present = group.dropna(subset=["round"])
        done = sorted(present["round"].astype(int))
        start = max(1, num_rounds - window + 1)
        win = present[(present["round"] >= start) & (present["round"] <= num_rounds)]
        recovery = win["recovery"].dropna()
        shard = (win["num_examples"] / win["num_clients"].where(win["num_clients"] > 0)).mean()
        row = {
            "run": run, "run_name": first["run_name"], **config,
            "bs": first["bs"], "tau": first["tau"], "K_c": first["K_c"],
            "num_rounds": num_rounds, "rounds_completed": len(done), "last_round": max(done, default=0),
            "complete": done == list(range(1, num_rounds + 1)),
            "window": window, "window_start": start, "window_rounds": len(win),
            **{m: win[m].median() for m in METRICS},
            "pct_below_1": 100.0 * float((recovery < 1).mean()) if len(recovery) else float("nan"),
            "mean_shard": shard, "T": local_steps(first["tau"], first["bs"], shard),
            "cell_id": _cell_id(config),
        }
        out.append(row)
    runs = pd.DataFrame(out)
    runs["cell"] = cell_labels(runs)
    return runs


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def incomplete_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[~runs["complete"].astype(bool)]


def run_config_columns(frame: pd.DataFrame) -> list[str]:
    """The run-config columns (kebab-case keys) of a run_summary or cell_summary frame."""
    return [c for c in frame.columns if c not in _DERIVED and not c.endswith(("_ref", "_ratio"))]


def varying_keys(runs: pd.DataFrame) -> list[str]:
    """Cell-defining run-config keys besides bs, tau, alpha whose value differs between runs."""
    out = []
    for key in run_config_columns(runs):
        if key in NOT_CELL_KEYS or key in {"batch-size", "local-epochs", "alpha"}:
            continue
        if runs[key].map(lambda v: json.dumps(v, default=str)).nunique() > 1:
            out.append(key)
    return out


def cell_labels(runs: pd.DataFrame) -> pd.Series:
    """A short name per run's cell: "bs=32 τ=2 α=100", plus any other key that differs between cells."""
    extra = varying_keys(runs)

    def label(row) -> str:
        parts = [f"bs={row['bs']}", f"τ={row['tau']}", f"α={row['alpha']:g}"]
        parts += [f"{k}={row[k]}" for k in extra]
        return " ".join(parts)

    return runs.apply(label, axis=1) if len(runs) else pd.Series(dtype=str)


def cell_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: the cell's keys, T, and the median across its runs (seeds) of each reported
    statistic; n_seeds, n_runs and n_incomplete count its runs.

    Sorted as the paper's tables: alpha descending, then batch size (numeric, then "full"), then tau.
    """
    extra = varying_keys(runs)
    out = []
    for _, group in runs.groupby("cell_id", sort=False):
        first = group.iloc[0]
        n_k = group["mean_shard"].mean()
        row = {
            "cell": first["cell"], "bs": first["bs"], "tau": int(first["tau"]), "alpha": float(first["alpha"]),
            "T": local_steps(first["tau"], first["bs"], n_k), "n_k": n_k, **{k: first[k] for k in extra},
            **{m: group[m].median() for m in REPORTED},
            "n_seeds": int(group["seed"].nunique()) if "seed" in group else len(group),
            "n_runs": len(group), "n_incomplete": int((~group["complete"].astype(bool)).sum()),
            "K_c": first["K_c"], "num_rounds": int(first["num_rounds"]), "window": int(first["window"]),
            "window_rounds": int(group["window_rounds"].min()),
            "rounds_completed": int(group["rounds_completed"].min()),
        }
        out.append(row)
    cells = pd.DataFrame(out)
    if cells.empty:
        return cells
    order = cells.assign(_a=-cells["alpha"], _b=cells["bs"].map(bs_order))
    try:
        order = order.sort_values([*extra, "_a", "_b", "tau"], kind="stable")
    except TypeError:  # a key with values of mixed types: sort it as text
        order = order.assign(**{k: order[k].map(str) for k in extra}).sort_values([*extra, "_a", "_b", "tau"])
    return cells.loc[order.index].reset_index(drop=True)


def cell_rounds(rounds: pd.DataFrame, runs: pd.DataFrame, columns: Sequence[str] = METRICS) -> pd.DataFrame:
    """Per cell and round, the median across the cell's runs of ``columns`` (for per-round plots)."""
    labelled = rounds.dropna(subset=["round"]).merge(runs[["run", "cell"]], on="run")
    return labelled.groupby(["cell", "round"], sort=False)[list(columns)].median().reset_index()


def decomposition_curve(r, k):
    """The signal-noise decomposition's recovery factor (K_c r + 1) / (r + 1), r = ‖μ‖²/σ²."""
    r = np.asarray(r, dtype=float)
    return (k * r + 1.0) / (r + 1.0)


# ---------------------------------------------------------------------------------------------
# Reference tables


def read_reference(path: str | Path) -> pd.DataFrame:
    """A CSV with columns bs, tau, alpha and any of REPORTED; one row per (bs, tau, alpha)."""
    path = Path(path)
    try:
        ref = pd.read_csv(path, dtype={"bs": str})
    except FileNotFoundError as exc:
        raise SummaryError(f"reference file {path} not found") from exc
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise SummaryError(f"reference file {path} is not a CSV table: {exc}") from exc
    ref.columns = [str(c).strip() for c in ref.columns]
    missing = [k for k in KEYS if k not in ref.columns]
    metrics = [m for m in REPORTED if m in ref.columns]
    if missing or not metrics:
        problems = []
        if missing:
            problems.append(f"lacks the key column(s) {', '.join(missing)}")
        if not metrics:
            problems.append(f"has none of the metric columns {', '.join(REPORTED)}")
        raise SummaryError(
            f"reference file {path} {' and '.join(problems)} (columns found: {', '.join(ref.columns)})"
        )
    try:
        ref = ref[[*KEYS, *metrics]].assign(
            bs=ref["bs"].map(lambda v: bs_label(float(v)) if bs_order(str(v).strip())[0] == 0 else bs_label(v)),
            tau=pd.to_numeric(ref["tau"], errors="raise").astype(int),
            alpha=pd.to_numeric(ref["alpha"], errors="raise").astype(float),
        )
        for m in metrics:
            ref[m] = pd.to_numeric(ref[m], errors="raise")
    except (ValueError, TypeError) as exc:
        raise SummaryError(f"reference file {path}: a key or metric value is not a number: {exc}") from exc
    duplicated = ref[ref.duplicated(list(KEYS), keep=False)]
    if not duplicated.empty:
        raise SummaryError(f"reference file {path} has more than one row for "
                           f"{duplicated[list(KEYS)].drop_duplicates().to_dict('records')}")
    return ref


def join_reference(cells: pd.DataFrame, ref: pd.DataFrame) -> pd.DataFrame:
    """cells with <metric>_ref and <metric>_ratio = ours / reference for every reference metric."""
    metrics = [m for m in REPORTED if m in ref.columns]
    ref = ref.rename(columns={m: f"{m}_ref" for m in metrics})
    joined = cells.merge(ref, on=list(KEYS), how="left", validate="many_to_one")
    for m in metrics:
        joined[f"{m}_ratio"] = joined[m] / joined[f"{m}_ref"]
    return joined


def unmatched_reference(cells: pd.DataFrame, ref: pd.DataFrame) -> pd.DataFrame:
    """Reference rows with no cell in the results."""
    keys = list(KEYS)
    merged = ref[keys].merge(cells[keys].drop_duplicates(), on=keys, how="left", indicator=True)
    return merged[merged["_merge"] == "left_only"][keys]


# ---------------------------------------------------------------------------------------------
# Printing and Fig. 1

_FORMATS = {
    "recovery": "{:.3f}", "recovery_weighted": "{:.3f}", "mu2_hat": "{:.3g}", "sigma2_hat": "{:.3g}",
    "test_accuracy": "{:.3f}", "pct_below_1": "{:.0f}", "T": "{:.0f}", "alpha": "{:g}", "n_k": "{:.0f}",
}


def _fmt(column: str):
    pattern = "{:.3f}" if column.endswith("_ratio") else _FORMATS.get(column.removesuffix("_ref"), "{}")

    def fmt(value) -> str:
        if isinstance(value, float | np.floating) and math.isnan(value):
            return "-"
        return pattern.format(value) if isinstance(value, int | float | np.number) else str(value)

    return fmt


def table_columns(cells: pd.DataFrame) -> list[str]:
    extra = run_config_columns(cells)
    return ["bs", "tau", "T", "alpha", *extra, *REPORTED, "n_seeds"]


def format_table(cells: pd.DataFrame, columns: Sequence[str] | None = None) -> str:
    """The cell table as text, in cell_summary's order; a note column flags cells with incomplete runs."""
    columns = list(columns or table_columns(cells))
    shown = cells[columns].copy()
    if "n_incomplete" in cells:
        notes = [f"{n}/{r} runs incomplete" if n else "" for n, r in zip(
            cells["n_incomplete"], cells["n_runs"], strict=True)]
        if any(notes):
            shown["note"] = notes
    return shown.to_string(index=False, na_rep="-", formatters={c: _fmt(c) for c in columns})


def protocol_note(cells: pd.DataFrame) -> str:
    """"paper protocol" or "reduced protocol: N rounds, window W" (what fig1's title says)."""
    rounds = sorted(cells["num_rounds"].unique())
    window = int(cells["window"].iloc[0])
    n = f"{rounds[0]}" if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
    if rounds[0] >= PAPER_ROUNDS and window == PAPER_WINDOW:
        return f"paper protocol: {n} rounds, window {window}"
    start = max(1, int(rounds[-1]) - window + 1)
    covered = f"rounds {start}-{rounds[-1]}" if len(rounds) == 1 else f"window {window}"
    return (f"reduced protocol: {n} rounds, window {window} ({covered}); "
            f"the paper's is {PAPER_ROUNDS} rounds, window {PAPER_WINDOW}")


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
        ax.set_yscale("log")
        ax.set_ylim(bottom / 1.5, top * 1.6)
        ticks = [t for t in (0.1, 0.2, 0.5, 1, 1.5, 2, 3, 5, 7, 10, 15, 20, 30, 50, 100)
                 if bottom / 1.5 <= t <= top * 1.6]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.yaxis.set_minor_formatter(NullFormatter())
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
        protocol_note(cells),
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
