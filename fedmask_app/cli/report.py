"""fedmask-report DIR...: the paper's table and Fig. 1 from run folders.

Per run: the median over its last --window rounds (rounds num-rounds - window + 1 .. num-rounds
that are present) of 1/ΔS (uniform and n_k-weighted), ‖μ̂‖², σ̂² and test accuracy, and the share
(%) of those rounds with 1/ΔS < 1. Per cell (every run-config key that defines the measurement,
seed excepted): the median across seeds. T is the number of local SGD steps per round for the
mean shard size n_k of the window's cohorts: tau for bs = full, else tau * ceil(n_k / bs).
Writes summary.csv (one row per cell) and fig1.png into --out.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from fedmask_app import report


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
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")

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
    cells = report.cell_summary(runs)
    duplicates = cells[cells["n_runs"] > cells["n_seeds"]]
    for _, cell in duplicates.iterrows():
        _warn(f"cell {cell['cell']} has {cell['n_runs']} runs for {cell['n_seeds']} seed(s): the same seed twice")

    out = args.out or args.dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(runs)} runs in {len(cells)} cells; {report.protocol_note(cells)}")
    print("per run: median over the window rounds; per cell: median across seeds. T = local SGD steps per round "
          "for the mean shard n_k of the window's cohorts (tau for bs=full, else tau*ceil(n_k/bs)); "
          "pct_below_1 = % of window rounds with recovery < 1; test_accuracy is a fraction.")
    print(report.format_table(cells))

    if reference is not None:
        cells = report.join_reference(cells, reference)
        metrics = [m for m in report.REPORTED if f"{m}_ratio" in cells]
        columns = ["bs", "tau", "alpha", *(c for m in metrics for c in (m, f"{m}_ref", f"{m}_ratio"))]
        print(f"\nagainst {args.reference} (ratio = ours / reference):")
        print(report.format_table(cells, columns))
        unmatched = report.unmatched_reference(cells, reference)
        if len(unmatched):
            _warn(f"{len(unmatched)} reference row(s) match no cell: {unmatched.to_dict('records')}")

    csv_path, fig_path = out / "summary.csv", out / "fig1.png"
    cells.drop(columns=["cell_id"], errors="ignore").to_csv(csv_path, index=False)
    report.fig1(cells, fig_path)
    print(f"\nwrote {csv_path} and {fig_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
