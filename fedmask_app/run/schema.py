"""The names of a run folder's files and the columns of rounds.csv (no torch import: the
report and the notebook read results with this alone)."""

ROUNDS_FILE = "rounds.csv"
CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "checkpoint.pt"
SHARDS_FILE = "shards.csv"  # optional: partition_id,num_examples per client (fedmask_app.report.shards)
ROUND_COLUMNS = (
    "round", "recovery", "recovery_weighted", "mean_sq_norm", "sq_norm_of_mean", "sigma2_hat", "mu2_hat",
    "test_accuracy", "test_loss", "train_loss", "num_clients", "num_examples", "num_failures", "cohort",
    "seconds", "server_lr", "keep_prob_round",
)
# The server's measurements (fedmask_app/measure; empty cells on rounds without them).
CURVATURE_ESTIMATES = (
    "probe_loss", "probe_recovery_weighted", "q_mean", "q_mean_se", "q_clients", "q_clients_se", "rho_h",
    "rho_h_se", "rho_h_flag", "penalty_sync", "penalty_sync_se", "penalty_ind", "penalty_ind_se", "rho_direct",
    "rho_direct_se", "rho_direct_flag", "penalty_sync_pred", "penalty_ind_pred",
)
FLATNESS_ESTIMATES = (
    "hessian_lambda_max", "hessian_lambda_max_residual", "hessian_lambda_max_iterations",
    "hessian_lambda_max_converged", "hessian_trace", "hessian_trace_se",
)
CURVATURE_COLUMNS = (*CURVATURE_ESTIMATES, "curvature_seconds")
FLATNESS_COLUMNS = (*FLATNESS_ESTIMATES, "flatness_seconds")
ALL_COLUMNS = (*ROUND_COLUMNS, *CURVATURE_COLUMNS, *FLATNESS_COLUMNS)
