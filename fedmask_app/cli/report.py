"""fedmask-report DIR...: the paper's table and Fig. 1 from run folders.

Per run: the median over its last --window rounds (rounds num-rounds - window + 1 .. num-rounds
that are present) of 1/ΔS (uniform and n_k-weighted), ‖μ̂‖², σ̂² and test accuracy, and the share
(%) of those rounds with 1/ΔS < 1 (pct_below_1; pct_below_1_all over all rounds). The recovery
statistics use full rounds only (every one of the K_c clients replied); short_rounds counts the
others, and a run with more than 10% of its window short is warned about. Per cell (every
run-config key that defines the measurement, seed excepted): the median across seeds. T is the
number of local SGD steps per round for the mean shard size n_k of the window's cohorts: tau for
bs = full, else tau * ceil(n_k / bs); T_min-T_max its range over the window's clients (from each
run's shards.csv). Curvature and flatness measurements: their median over the window rounds that
have them.

Writes into --out: summary.csv (one row per cell) and fig1.png; curvature_pooled.csv when any run
has Q sums or penalties in its window (per cell, ρ_H, ρ_direct and the expansion's check pooled
over the window's measured rounds, with 95% intervals from resampling them); curvature.png and
curvature_rounds.png (the measurements round by round) when any run has ρ_H values;
sharpness.csv and sharpness_rounds.png when any run measured λ_max (flatness-every): per run, λ_max
against the edge of stability 2 / (lr · server_lr) where a round is one plain full-batch gradient
step and against a local SGD step's edge 2 (1 + momentum) / lr − weight-decay
(fedmask_app/report/sharpness.py), and the first measured round at or above each; comparison.csv
and comparison.png when the runs differ in mask-mode, server-step or mask-granularity;
at_accuracy.csv, at_accuracy_cells.csv and recovery_vs_accuracy.png with --at-accuracy, and
curvature_at_accuracy.csv when runs have curvature measurements; curvature_windows.csv and
curvature_windows.png with --curvature-windows.

--at-accuracy LEVEL...: each run read where it first reaches a test accuracy instead of at its last
round, so runs at different stages of training (another model, optimizer, split) compare at equal
accuracy: for each level, the first round r whose median test accuracy over rounds r - window + 1
.. r reaches it, and the window medians of 1/ΔS, ‖μ̂‖², σ̂² over those rounds (full rounds only);
per cell and level, the median of those across the seeds that reach it, and their 1/ΔS range. With
curvature measurements, also ρ_H, ρ_direct and the expansion's check per cell and level, pooled
over the measured full rounds of those windows, seeds together (curvature_at_accuracy.csv), so
rho_H of two models compares at one stage of training.

--curvature-windows FIRST-LAST...: the curvature ratios of curvature_pooled.csv in each of these
windows of rounds instead of the paper's window alone (e.g. 5-50 51-100 101-150 151-200), per cell
its seeds' measured full rounds pooled, with the test accuracy over each window's rounds
(fedmask_app/report/windows.py), and a figure of ρ_H against 1/ΔS_w and of κ window by window.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from fedmask_app import report


def _four_digits(x: float) -> str:
    return f"{x:.4g}"


def _warn(message: str) -> None:
    print(f"fedmask-report: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedmask-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR",
                        help="a run folder, or a folder holding run folders (searched recursively)")
    parser.add_argument("--window", type=int, default=report.PAPER_WINDOW,
                        help=f"rounds at the end of each run to take the median over (paper: {report.PAPER_WINDOW})")
    parser.add_argument("--out", type=Path, default=None, help="where summary.csv and fig1.png go (default: first DIR)")
    parser.add_argument("--reference", type=Path, default=None, metavar="FILE.csv",
                        help="a table with columns bs, tau, alpha and any of "
                             f"{', '.join(report.REPORTED)}: adds <metric>_ref and <metric>_ratio = ours / reference")
    parser.add_argument("--at-accuracy", type=float, nargs="+", default=[], metavar="LEVEL",
                        help="also read each run where its windowed test accuracy first reaches LEVEL "
                             "(a fraction, e.g. 0.4 0.45): at_accuracy.csv, at_accuracy_cells.csv, "
                             "recovery_vs_accuracy.png, and curvature_at_accuracy.csv when runs have "
                             "curvature measurements")
    parser.add_argument("--curvature-windows", nargs="+", default=[], metavar="FIRST-LAST",
                        help="also pool each cell's curvature ratios in these windows of rounds "
                             "(e.g. 5-50 51-100 101-150 151-200): curvature_windows.csv")
    args = parser.parse_args(argv)
    try:
        windows = [report.parse_window(w) for w in args.curvature_windows]
    except ValueError as exc:
        parser.error(f"--curvature-windows: {exc}")
    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")
    try:
        report.check_levels(args.at_accuracy)
    except ValueError as exc:
        parser.error(f"--at-accuracy {exc}")

    try:
        reference = report.read_reference(args.reference) if args.reference else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rounds = report.load_runs(args.dirs)
    except report.SummaryError as exc:
        print(f"fedmask-report: {exc}", file=sys.stderr)
        return 2
    for warning in caught:
        _warn(str(warning.message))

    runs = report.run_summary(rounds, args.window)
    for _, run in report.incomplete_runs(runs).iterrows():
        _warn(f"incomplete run {run['run']}: {run['rounds_completed']} of {run['num_rounds']} rounds, "
              f"{run['window_rounds']} in the window (rounds {run['window_start']}-{run['num_rounds']}); "
              "included, flagged in the table")
    for _, run in runs[runs["many_short"].astype(bool)].iterrows():
        _warn(f"run {run['run']}: {run['short_rounds']} of its {run['window_rounds']} window rounds had fewer than "
              f"K_c = {run['K_c']} good replies (> {report.SHORT_ROUNDS_LIMIT:.0%}); they are left out of its "
              "recovery statistics")
    no_shards = runs[runs["T_min"].isna() & (runs["bs"] != "full")]
    if len(no_shards):
        _warn(f"{len(no_shards)} run(s) without a usable shards.csv: T_min/T_max unknown for their cells")
    cells = report.cell_summary(runs)
    duplicates = cells[cells["n_runs"] > cells["n_seeds"]]
    for _, cell in duplicates.iterrows():
        _warn(f"cell {cell['cell']} has {cell['n_runs']} runs for {cell['n_seeds']} seed(s): the same seed twice")

    out = args.out or args.dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(runs)} runs in {len(cells)} cells; {report.protocol_note(cells)}")
    print(report.table_note(cells))
    print(report.format_table(cells, report.table_columns(cells, measurements=False)))
    measured = report.measurement_columns(cells)
    if measured:
        print("\ncurvature and flatness (same cells, the per-cell table's last columns):")
        print(report.format_table(cells, ["bs", "tau", "alpha", *report.varying_keys(cells), *measured]))

    if reference is not None:
        cells = report.join_reference(cells, reference)
        metrics = [m for m in report.REPORTED if f"{m}_ratio" in cells]
        columns = ["bs", "tau", "alpha", *(c for m in metrics for c in (m, f"{m}_ref", f"{m}_ratio"))]
        print(f"\nagainst {args.reference} (ratio = ours / reference):")
        print(report.format_table(cells, columns))
        unmatched = report.unmatched_reference(cells, reference)
        if len(unmatched):
            _warn(f"{len(unmatched)} reference row(s) match no cell: {unmatched.to_dict('records')}")

    written = [out / "summary.csv", out / "fig1.png"]
    cells.drop(columns=["cell_id"], errors="ignore").to_csv(written[0], index=False)
    report.fig1(cells, written[1])
    pooled = report.pooled_cells(rounds, runs)
    if len(pooled):
        print(f"\ncurvature pooled over each cell's window ({report.POOLED_NOTE}):")
        print(report.format_pooled(pooled))
        written.append(out / "curvature_pooled.csv")
        pooled.to_csv(written[-1], index=False)
    if windows:
        by_window = report.cell_windows(rounds, runs, windows)
        if len(by_window):
            print(f"\ncurvature pooled per cell in each window ({report.POOLED_NOTE}; test accuracy: the median over "
                  "every round of the window):")
            print(report.format_cell_windows(by_window))
            written += [out / "curvature_windows.csv", out / "curvature_windows.png"]
            by_window.to_csv(written[-2], index=False)
            report.curvature_windows_figure(by_window, written[-1])
        else:
            _warn("--curvature-windows: no run has curvature measurements in these windows; nothing written")
    if report.has_curvature(rounds):
        written += [out / "curvature.png", out / "curvature_rounds.png"]
        report.curvature_figure(cells, written[-2])
        report.curvature_rounds_figure(rounds, written[-1])
    sharpness = report.sharpness_table(rounds)
    if len(sharpness):
        print(f"\nsharpness {report.SHARPNESS_NOTE}:")
        print(sharpness.to_string(index=False, float_format=_four_digits))
        written += [out / "sharpness.csv", out / "sharpness_rounds.png"]
        sharpness.to_csv(written[-2], index=False)
        report.sharpness_figure(rounds, written[-1])
    if report.compares_training(runs):
        table = report.comparison_table(runs)
        print(f"\nmasking comparison ({report.SPREAD_NOTE}):")
        print(report.format_comparison(table))
        written += [out / "comparison.csv", out / "comparison.png"]
        table.to_csv(written[-2], index=False)
        report.comparison_figure(rounds, runs, written[-1])
    if args.at_accuracy:
        table = report.at_accuracy(rounds, runs, args.at_accuracy, args.window)
        print(f"\nat equal test accuracy (window medians over the {args.window} rounds ending where each run "
              "first reaches the level; NaN: never reached):")
        print(table.drop(columns=["run", "run_name"]).to_string(index=False, float_format=_four_digits))
        cells_there = report.cell_at_accuracy(table)
        print("\nper cell, the median across the seeds that reach each level (n_reached of n_runs) and their "
              "1/ΔS range:")
        print(cells_there.to_string(index=False, float_format=_four_digits))
        written += [out / "at_accuracy.csv", out / "at_accuracy_cells.csv", out / "recovery_vs_accuracy.png"]
        table.drop(columns=["run"]).to_csv(written[-3], index=False)  # run: an absolute path
        cells_there.to_csv(written[-2], index=False)
        report.recovery_accuracy_figure(rounds, table, args.window, written[-1])
        curvature_there = report.curvature_at_accuracy(rounds, table)
        if len(curvature_there):
            print(f"\ncurvature at equal test accuracy, per cell its seeds' measured full rounds in the {args.window}"
                  f" rounds ending where each reaches the level ({report.POOLED_NOTE}):")
            print(report.format_curvature_at_accuracy(curvature_there))
            written.append(out / "curvature_at_accuracy.csv")
            curvature_there.to_csv(written[-1], index=False)
    print(f"\nwrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
