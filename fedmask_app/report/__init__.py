"""Reading results the way the paper does: run folders as data (runs), per-run and per-cell
medians and their table (tables), a reference join (reference), Fig. 1 (figures). No torch."""

from fedmask_app.report.figures import decomposition_curve, fig1
from fedmask_app.report.reference import join_reference, read_reference, unmatched_reference
from fedmask_app.report.runs import (
    KEYS,
    METRICS,
    NOT_CELL_KEYS,
    PAPER_ROUNDS,
    PAPER_WINDOW,
    REPORTED,
    ROUND_COLUMNS,
    SummaryError,
    config_keys,
    find_run_dirs,
    load_runs,
)
from fedmask_app.report.tables import (
    cell_labels,
    cell_rounds,
    cell_summary,
    format_table,
    incomplete_runs,
    local_steps,
    protocol_note,
    run_summary,
    table_columns,
)

__all__ = [
    "KEYS", "METRICS", "NOT_CELL_KEYS", "PAPER_ROUNDS", "PAPER_WINDOW", "REPORTED", "ROUND_COLUMNS", "SummaryError",
    "cell_labels", "cell_rounds", "cell_summary", "config_keys", "decomposition_curve", "fig1", "find_run_dirs",
    "format_table", "incomplete_runs", "join_reference", "load_runs", "local_steps", "protocol_note",
    "read_reference", "run_summary", "table_columns", "unmatched_reference",
]
