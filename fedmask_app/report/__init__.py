"""Reading results the way the paper does: run folders as data (runs, shards), per-run and per-cell
medians and their table (tables), what differs from the paper's protocol (protocol), a reference
join (reference), Fig. 1 (figures), the server's curvature measurements (curvature), their ratios
pooled per cell (pooled) and window by window (windows), the masking comparison (comparison), runs
read at equal test accuracy (stage). No torch."""

from fedmask_app.report.comparison import (
    SPREAD_NOTE,
    TRAINING_KEYS,
    compares_training,
    comparison_figure,
    comparison_table,
    format_comparison,
)
from fedmask_app.report.curvature import (
    MEASURES,
    curvature_figure,
    curvature_rounds_figure,
    curvature_windows_figure,
    has_curvature,
    measured_rounds,
    measurement_columns,
)
from fedmask_app.report.figures import decomposition_curve, fig1
from fedmask_app.report.pooled import (
    DERIVED_RATIOS,
    POOLED_NOTE,
    POOLED_RATIOS,
    disagreement_curvature,
    excess_over_euclidean,
    format_pooled,
    pooled_cells,
    pooled_ratio,
)
from fedmask_app.report.protocol import protocol_deviations, protocol_note
from fedmask_app.report.reference import join_reference, read_reference, unmatched_reference
from fedmask_app.report.runs import (
    CONFIG_DEFAULTS,
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
from fedmask_app.report.shards import SHARDS_COLUMNS, read_shards
from fedmask_app.report.sharpness import (
    SHARPNESS_COLUMNS,
    SHARPNESS_NOTE,
    sharpness_figure,
    sharpness_table,
    stability_edge,
    step_edge,
)
from fedmask_app.report.stage import (
    AT_ACCURACY_COLUMNS,
    CELL_AT_ACCURACY_COLUMNS,
    CURVATURE_AT_ACCURACY_COLUMNS,
    at_accuracy,
    cell_at_accuracy,
    check_levels,
    curvature_at_accuracy,
    format_curvature_at_accuracy,
    recovery_accuracy_figure,
    windowed_medians,
)
from fedmask_app.report.tables import (
    RECOVERY_METRICS,
    SHORT_ROUNDS_LIMIT,
    cell_labels,
    cell_rounds,
    cell_summary,
    format_table,
    incomplete_runs,
    local_steps,
    run_summary,
    table_columns,
    table_note,
    varying_keys,
)
from fedmask_app.report.windows import (
    WINDOWS,
    cell_windows,
    format_cell_windows,
    format_excess,
    format_interval,
    format_pooled_windows,
    format_windows,
    measured_full_rounds,
    parse_window,
    rounds_window_ratios,
    window_ratios,
)

__all__ = [
    "AT_ACCURACY_COLUMNS", "CELL_AT_ACCURACY_COLUMNS", "CONFIG_DEFAULTS", "CURVATURE_AT_ACCURACY_COLUMNS",
    "DERIVED_RATIOS", "KEYS", "MEASURES", "METRICS", "NOT_CELL_KEYS", "PAPER_ROUNDS", "PAPER_WINDOW", "POOLED_NOTE",
    "POOLED_RATIOS", "RECOVERY_METRICS", "REPORTED", "ROUND_COLUMNS", "SHARDS_COLUMNS", "SHARPNESS_COLUMNS",
    "SHARPNESS_NOTE", "SHORT_ROUNDS_LIMIT", "SPREAD_NOTE", "TRAINING_KEYS", "WINDOWS", "SummaryError", "at_accuracy",
    "cell_at_accuracy", "cell_labels", "cell_rounds", "cell_summary", "cell_windows", "check_levels",
    "compares_training", "comparison_figure", "comparison_table", "config_keys", "curvature_at_accuracy",
    "curvature_figure", "curvature_rounds_figure", "curvature_windows_figure", "decomposition_curve",
    "disagreement_curvature", "excess_over_euclidean", "fig1", "find_run_dirs", "format_cell_windows",
    "format_comparison", "format_curvature_at_accuracy", "format_excess", "format_interval", "format_pooled",
    "format_pooled_windows", "format_table", "format_windows", "has_curvature", "incomplete_runs", "join_reference",
    "load_runs", "local_steps", "measured_full_rounds", "measured_rounds", "measurement_columns", "parse_window",
    "pooled_cells", "pooled_ratio", "protocol_deviations", "protocol_note", "read_reference", "read_shards",
    "recovery_accuracy_figure", "rounds_window_ratios", "run_summary", "sharpness_figure", "sharpness_table",
    "stability_edge", "step_edge", "table_columns", "table_note", "unmatched_reference", "varying_keys",
    "window_ratios", "windowed_medians",
]
