"""The names of a run folder's files and the columns of rounds.csv (no torch import: the
report and the notebook read results with this alone)."""

ROUNDS_FILE = "rounds.csv"
CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "checkpoint.pt"
ROUND_COLUMNS = (
    "round", "recovery", "recovery_weighted", "mean_sq_norm", "sq_norm_of_mean", "sigma2_hat", "mu2_hat",
    "test_accuracy", "test_loss", "train_loss", "num_clients", "num_examples", "num_failures", "cohort",
    "seconds",
)
