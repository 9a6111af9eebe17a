"""Known-answer test: ``linear-softmax`` runs through both engines against an independent float64
numpy reference.

The identical-shards control proves determinism, not correctness. Here every number of a short
run -- θ after two rounds (checkpoint.pt) and every statistic of rounds.csv -- is recomputed in
plain numpy, float64, from PAPER.md's equations: the softmax cross-entropy gradient of
W x + b, the SGD steps in the batch order drawn from the documented seed (``batch_order_seed``
fed to ``torch.randperm``), Δ_k = θ − θ_k, the masks from ``independent_mask_seed`` /
``synchronized_mask_seed``, θ ← θ − Σ_k w_k (m_k^(b)/p) Δ_k^(b) with w_k = 1/K_c or n_k/Σn, and
the statistics on the unmasked Δ_k. The data pipeline (CIFAR-10 file, Dirichlet partition,
``max-shard-size``) and the cohort draw are reused from the app: they are not what is tested.

The setup (seed 5, α = 0.1, 100 clients, 3 a round, shards cut at 40) is chosen so that the
cohorts hold shards of unequal size (40, 40, 29 and 40, 8, 40: weighted ≠ uniform), the
synchronized masks keep each of the 2 blocks in one round and drop it in the other, and the
independent masks differ across the clients of a round (``test_the_setup_exercises_what_it_checks``).

Which assertion catches which bug (``test_the_comparison_rejects_broken_references`` feeds the
comparison references computed with each bug and checks that it fails, and on which column):

* Δ with the wrong sign (θ_k − θ): round 1's step is reversed, so θ moves along the gradient.
  The statistics are quadratic in Δ and do not see a sign in round 1, but the θ comparison
  fails (and round 2's statistics, computed at the wrong θ_1);
  ``test_the_model_moves_against_the_gradient`` checks the direction on its own:
  θ_1 − θ_0 = −lr Σ_k w_k ∇L_k(θ_0), cosine −1 with the gradient.
* replies aliasing one buffer (every Δ_k equal to one client's): ‖ΣΔ_k‖² = K_c² ‖Δ‖², so the
  rounds.csv ``recovery`` would read K_c = 3 exactly and ``sigma2_hat`` 0, against reference
  values of about 1.29 / 0.95 and σ̂² ≈ 0.9·A; the comparison of ``recovery``, ``sigma2_hat`` and θ
  fails (``test_clients_with_different_shards_give_different_updates`` also requires
  recovery < K_c and σ̂² > 0 in the run itself).
* a wrong 1/p scale (m instead of m/p, or m/p²): the kept blocks' step changes by a factor p
  (or 1/p), so θ after round 1 is off by half (or all) of that step; the θ comparison fails, and
  so do round 2's statistics (computed at the wrong θ_1). The setup guarantees kept blocks in
  every masked configuration, so a wrong scale cannot hide behind all-dropped masks.
* a broken per-client batch order (the shared order of the identical-shards control, or no
  shuffle): full-batch training does not see the order, so the minibatch configurations (bs 16,
  τ = 2, shards of 40 and 29 samples: a short last batch, whose samples weigh 1/8 or 1/13
  instead of 1/16) are there to catch it: Δ_k changes at first order through the short batch,
  and further through the steps in between, so the statistics of both rounds and θ fail.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from flwr_runner import SHARED_DATA, write_run_config

from clients.masking import block_mask, coordinate_mask
from clients.seeds import batch_order_seed, independent_mask_seed, synchronized_mask_seed
from fedmask_app.engines.local import run_local
from fedmask_app.run.client_task import client_shards
from fedmask_app.run.config import RunConfig, load_run_config
from fedmask_app.run.data import CHANNEL_MEAN, CHANNEL_STD, load_dataset, resolve_data_dir
from fedmask_app.run.model import initial_parameters
from fedmask_app.run.results import RunResults
from strategies.cohort import sample_cohort

SEED, ALPHA, NUM_CLIENTS, COHORT, SHARD, ROUNDS, LR, KEEP, TEST_SUBSET = 5, 0.1, 100, 3, 40, 2, 0.01, 0.5, 200
STATS = ("recovery", "recovery_weighted", "mean_sq_norm", "sq_norm_of_mean", "sigma2_hat", "mu2_hat")
MINIBATCH = (16, 2)  # (batch size, local epochs)
STAT_RTOL = 1e-4  # float32 updates summed in float64 vs float64 updates
THETA_RTOL = 1e-5  # ‖θ_run − θ_ref‖ per block, relative to ‖θ_ref − θ_0‖ (the displacement)


def run_values(tmp_path: Path, name: str, mask_mode: str, aggregation: str, batch: str | int, epochs: int,
               **overrides) -> dict:
    return {
        "seed": SEED, "num-clients": NUM_CLIENTS, "clients-per-round": COHORT, "num-rounds": ROUNDS,
        "alpha": ALPHA, "min-partition-size": 2, "max-shard-size": SHARD, "model": "linear-softmax",
        "local-epochs": epochs, "batch-size": batch, "lr": LR, "mask-mode": mask_mode, "keep-prob": KEEP,
        "aggregation": aggregation, "eval-every": 1, "test-subset": TEST_SUBSET, "checkpoint-every": 1,
        "threads": 1, "data-dir": str(SHARED_DATA), "output-dir": str(tmp_path), "run-name": name, **overrides,
    }


# ---------------------------------------------------------------- the float64 numpy reference


def features(images: np.ndarray) -> np.ndarray:
    """uint8 NHWC -> float64 rows of the flattened CHW image, standardised per channel."""
    x = images.astype(np.float64).transpose(0, 3, 1, 2) / 255.0
    x = (x - np.asarray(CHANNEL_MEAN).reshape(1, 3, 1, 1)) / np.asarray(CHANNEL_STD).reshape(1, 3, 1, 1)
    return x.reshape(len(images), -1)


def softmax_xent(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean cross-entropy of softmax(x Wᵀ + b) and its gradients (∂/∂W, ∂/∂b)."""
    z = x @ w.T + b
    z -= z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    n = len(y)
    loss = -float(log_p[np.arange(n), y].mean())
    g = np.exp(log_p)
    g[np.arange(n), y] -= 1.0
    g /= n
    return loss, g.T @ x, g.sum(axis=0)


@dataclass
class Reference:
    thetas: list[list[np.ndarray]]  # θ_0, θ_1, ..., float64
    rows: list[dict[str, float]]
    deltas: list[dict[int, list[np.ndarray]]] = field(default_factory=list)  # per round: pid -> Δ_k
    grads: list[dict[int, list[np.ndarray]]] = field(default_factory=list)  # per round: pid -> ∇L_k(θ)
    sizes: dict[int, int] = field(default_factory=dict)
    masks: list[dict[int, np.ndarray | list[np.ndarray]]] = field(default_factory=list)  # per round: pid -> keep
    # per block (per tensor: a bool each; per coordinate: a bool array shaped like each tensor)


def reference_run(cfg: RunConfig, bug: str | None = None) -> Reference:
    """The run ``cfg`` describes, in float64 numpy. ``bug`` computes it the wrong way on purpose:
    "sign", "alias", "no-rescale", "double-rescale", "shared-order", "no-shuffle", "tensor-masks"
    (per-tensor masks where the run drew them per coordinate)."""
    data = load_dataset(resolve_data_dir(cfg.data_dir))
    shards = client_shards(cfg, data.y_train)
    theta = [p.double().numpy() for p in initial_parameters(cfg.model, cfg.seed)]
    ref = Reference(thetas=[theta], rows=[])
    x_test, y_test = features(data.x_test[: cfg.test_subset]), data.y_test[: cfg.test_subset]
    keep_prob = cfg.keep_prob  # p_t: round 1's, then the calibrated schedule's
    for server_round in range(1, cfg.num_rounds + 1):
        cohort = sample_cohort(cfg.seed, server_round, range(cfg.num_clients), cfg.clients_per_round)
        deltas, grads, counts, losses, masks = {}, {}, {}, {}, {}
        for pid in cohort:
            x, y = features(data.x_train[shards[pid]]), data.y_train[shards[pid]]
            n = len(y)
            counts[pid] = ref.sizes[pid] = n
            _, gw, gb = softmax_xent(*theta, x, y)
            grads[pid] = [gw, gb]
            key = None if bug == "shared-order" else pid
            generator = torch.Generator().manual_seed(batch_order_seed(cfg.seed, server_round, key))
            w, b = theta[0].copy(), theta[1].copy()
            batch = cfg.batch_size or n
            loss_sum = 0.0
            for _ in range(cfg.local_epochs):
                order = torch.randperm(n, generator=generator).numpy()
                if bug == "no-shuffle":
                    order = np.arange(n)
                for start in range(0, n, batch):
                    idx = order[start : start + batch]
                    loss, gw, gb = softmax_xent(w, b, x[idx], y[idx])
                    w -= cfg.lr * gw
                    b -= cfg.lr * gb
                    loss_sum += loss * len(idx)
            losses[pid] = loss_sum / (n * cfg.local_epochs)
            delta = [theta[0] - w, theta[1] - b]
            deltas[pid] = [-d for d in delta] if bug == "sign" else delta
            seed = {
                "independent": independent_mask_seed(cfg.seed, server_round, pid),
                "synchronized": synchronized_mask_seed(cfg.seed, server_round),
            }.get(cfg.mask_mode)
            if seed is None:
                masks[pid] = np.ones(2, dtype=bool)
            elif cfg.mask_granularity == "coordinate" and bug != "tensor-masks":
                masks[pid] = [coordinate_mask(seed, blk, t.size, keep_prob).reshape(t.shape)
                              for blk, t in enumerate(theta)]
            else:
                masks[pid] = block_mask(seed, 2, keep_prob)
        if bug == "alias":  # every reply reads the buffer the last client wrote
            deltas = {pid: deltas[cohort[-1]] for pid in cohort}
        total = sum(counts.values())
        weights = {pid: (counts[pid] / total if cfg.aggregation == "weighted" else 1 / len(cohort)) for pid in cohort}
        scale = {"no-rescale": 1.0, "double-rescale": 1 / keep_prob**2}.get(bug, 1 / keep_prob)
        if cfg.mask_mode == "none":
            scale = 1.0
        flat = {pid: np.concatenate([d.ravel() for d in deltas[pid]]) for pid in cohort}
        mean_update = sum(weights[pid] * flat[pid] for pid in cohort)
        b_w = float(mean_update @ mean_update)  # ‖Σ_k w_k Δ_k‖²
        server_lr = 1.0
        if cfg.server_step == "fedexp":  # η_g = max{1, Σ w_k‖Δ_k‖² / (2(B_w + K_c ε_t))}, ε_t = ε_0 0.998^(2t)
            a_w = sum(weights[pid] * float(flat[pid] @ flat[pid]) for pid in cohort)
            epsilon = cfg.fedexp_epsilon * 0.998 ** (2 * server_round)
            server_lr = max(1.0, a_w / (2 * (b_w + len(cohort) * epsilon)))
        theta = [
            theta[blk] - server_lr * sum(weights[pid] * masks[pid][blk] * scale * deltas[pid][blk] for pid in cohort)
            for blk in range(2)
        ]
        ref.thetas.append(theta)
        ref.deltas.append(deltas)
        ref.grads.append(grads)
        ref.masks.append(masks)
        ref.rows.append({
            **statistics([deltas[pid] for pid in cohort], [counts[pid] for pid in cohort]),
            "train_loss": sum(losses[pid] * counts[pid] for pid in cohort) / total,
            "num_examples": total,
            "num_clients": len(cohort),
            "cohort": " ".join(map(str, cohort)),
            "server_lr": server_lr,
            "keep_prob_round": keep_prob,
            **evaluation(theta, x_test, y_test),
        })
        if cfg.keep_prob_schedule == "calibrated":  # p_{t+1} = B_t / (B_t + 2c), clipped to [p_min, 1]
            keep_prob = min(1.0, max(cfg.keep_prob_min, b_w / (b_w + 2 * cfg.penalty_target)))
    return ref


def statistics(deltas: list[list[np.ndarray]], counts: list[int]) -> dict[str, float]:
    """PAPER.md's statistics, each from its equation."""
    flat = [np.concatenate([d.ravel() for d in delta]) for delta in deltas]
    k = len(flat)
    w = np.asarray(counts, dtype=np.float64) / sum(counts)
    sq = [float(f @ f) for f in flat]
    mean = sum(flat) / k
    weighted_mean = sum(wk * f for wk, f in zip(w, flat, strict=True))
    a = sum(sq) / k
    b = float(mean @ mean)
    sigma2 = (a - b) / (1 - 1 / k)
    return {
        "recovery": float(sum(flat) @ sum(flat)) / sum(sq),
        "recovery_weighted": float(weighted_mean @ weighted_mean) / sum(wk**2 * s for wk, s in zip(w, sq, strict=True)),
        "mean_sq_norm": a,
        "sq_norm_of_mean": b,
        "sigma2_hat": sigma2,
        "mu2_hat": a - sigma2,
    }


def evaluation(theta: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    loss, _, _ = softmax_xent(*theta, x, y)
    accuracy = float(((x @ theta[0].T + theta[1]).argmax(axis=1) == y).mean())
    return {"test_loss": loss, "test_accuracy": accuracy}


# ---------------------------------------------------------------- comparing a run with the reference


@dataclass
class RunOutput:
    rows: pd.DataFrame
    theta: list[np.ndarray]  # checkpoint.pt after the last round


def read_run(cfg: RunConfig) -> RunOutput:
    checkpoint = RunResults(cfg.run_dir).load_checkpoint()
    assert checkpoint is not None, f"no checkpoint in {cfg.run_dir}"
    assert checkpoint.server_round == cfg.num_rounds
    return RunOutput(pd.read_csv(cfg.run_dir / "rounds.csv"), checkpoint.params)


def mismatches(run: RunOutput, ref: Reference) -> list[str]:
    """Every way the run differs from the reference beyond float32 rounding ([] when it matches)."""
    found = []
    if run.rows["round"].tolist() != list(range(1, len(ref.rows) + 1)):
        return [f"rounds {run.rows['round'].tolist()}"]
    for r, expected in enumerate(ref.rows):
        got = run.rows.iloc[r]
        scale = expected["mean_sq_norm"]  # σ̂² and ‖μ̂‖² are differences of terms of this size
        for column in (*STATS, "train_loss", "test_loss", "server_lr"):
            atol = STAT_RTOL * scale if column in ("sigma2_hat", "mu2_hat") else 0.0
            if not math.isclose(float(got[column]), expected[column], rel_tol=STAT_RTOL, abs_tol=atol):
                found.append(f"round {r + 1} {column}: run {got[column]!r}, reference {expected[column]!r}")
        if abs(float(got["test_accuracy"]) - expected["test_accuracy"]) > 1.5 / TEST_SUBSET:  # one near-tie may flip
            found.append(f"round {r + 1} test_accuracy: run {got['test_accuracy']}, "
                         f"reference {expected['test_accuracy']}")
        if run.rows["keep_prob_round"].notna().any() and not math.isclose(
                float(got["keep_prob_round"]), expected["keep_prob_round"], rel_tol=STAT_RTOL):
            found.append(f"round {r + 1} keep_prob_round: run {got['keep_prob_round']}, "
                         f"reference {expected['keep_prob_round']}")
        for column in ("num_examples", "num_clients", "cohort", "num_failures"):
            want = 0 if column == "num_failures" else expected[column]
            if str(got[column]) != str(want):
                found.append(f"round {r + 1} {column}: run {got[column]!r}, reference {want!r}")
    for blk, (got, want, start) in enumerate(zip(run.theta, ref.thetas[-1], ref.thetas[0], strict=True)):
        assert got.dtype == np.float32 and got.shape == want.shape
        error = np.linalg.norm(got.astype(np.float64) - want)
        moved = np.linalg.norm(want - start)
        if not error <= THETA_RTOL * moved:
            found.append(f"theta block {blk}: ‖θ_run − θ_ref‖ = {error:.3g}, ‖θ_ref − θ_0‖ = {moved:.3g}")
    return found


# ---------------------------------------------------------------- the local engine: every combination

CONFIGS = [
    (mask_mode, aggregation, batch)
    for mask_mode, aggregation, batch in itertools.product(
        ("none", "independent", "synchronized"), ("uniform", "weighted"), ("full", "minibatch")
    )
]


def config_args(batch: str) -> tuple[str | int, int]:
    return ("full", 1) if batch == "full" else MINIBATCH


def local_run(tmp_path: Path, mask_mode: str, aggregation: str, batch: str, **overrides) -> tuple[RunConfig, RunOutput]:
    name = f"{mask_mode}-{aggregation}-{batch}"
    values = run_values(tmp_path, name, mask_mode, aggregation, *config_args(batch), **overrides)
    cfg = load_run_config([str(write_run_config(tmp_path / f"{name}.toml", values))])
    run_local(cfg, echo=lambda _: None)
    return cfg, read_run(cfg)


@pytest.mark.parametrize("vectorize", [False, True], ids=["local", "local-vectorized"])
@pytest.mark.parametrize(("mask_mode", "aggregation", "batch"), CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_local_engine_matches_the_numpy_reference(tmp_path, mask_mode, aggregation, batch, vectorize):
    """Client by client, and the whole cohort in one batched computation (``vectorize``)."""
    cfg, run = local_run(tmp_path, mask_mode, aggregation, batch, vectorize=vectorize)
    assert mismatches(run, reference_run(cfg)) == []


COORDINATE_CONFIGS = [("independent", "weighted", "minibatch"), ("synchronized", "uniform", "full")]


@pytest.mark.parametrize(("mask_mode", "aggregation", "batch"), COORDINATE_CONFIGS,
                         ids=["-".join(c) for c in COORDINATE_CONFIGS])
def test_coordinate_masks_match_the_numpy_reference(tmp_path, mask_mode, aggregation, batch):
    """mask-granularity = "coordinate": every weight its own Bernoulli(p) draw, regenerated by the
    server from the clients' mask seeds."""
    cfg, run = local_run(tmp_path, mask_mode, aggregation, batch, **{"mask-granularity": "coordinate"})
    ref = reference_run(cfg)
    assert mismatches(run, ref) == []
    assert mismatches(run, reference_run(cfg, "tensor-masks")) != []
    for masks in ref.masks:  # every tensor has kept and dropped coordinates
        for per_tensor in masks.values():
            assert all(0 < m.sum() < m.size for m in per_tensor)


SERVER_STEP_CONFIGS = {  # name -> (mask-mode, aggregation, batch, overrides)
    "fedexp-unmasked": ("none", "weighted", "full", {"server-step": "fedexp", "fedexp-epsilon": 1e-8}),
    "fedexp-independent": ("independent", "uniform", "minibatch", {"server-step": "fedexp"}),
    "calibrated": ("synchronized", "weighted", "minibatch",
                   {"keep-prob-schedule": "calibrated", "penalty-target": 0.002, "num-rounds": 3}),
}


@pytest.mark.parametrize("name", list(SERVER_STEP_CONFIGS))
def test_server_steps_match_the_numpy_reference(tmp_path, name):
    """FedExP's η_g and the calibrated keep-prob, each from its equation (strategies/server_step.py's
    docstrings), against a run of the local engine; η_g > 1 and p_t != keep-prob actually happen."""
    mask_mode, aggregation, batch, overrides = SERVER_STEP_CONFIGS[name]
    cfg, run = local_run(tmp_path, mask_mode, aggregation, batch, **overrides)
    ref = reference_run(cfg)
    assert mismatches(run, ref) == []
    if cfg.server_step == "fedexp":
        assert max(row["server_lr"] for row in ref.rows) > 1.05
    else:
        assert len({round(row["keep_prob_round"], 6) for row in ref.rows}) == cfg.num_rounds


def test_the_setup_exercises_what_it_checks(tmp_path):
    """Unequal shard sizes in every cohort, masks that keep and drop, independent masks that differ."""
    values = run_values(tmp_path, "setup", "independent", "weighted", "full", 1)
    cfg = load_run_config([str(write_run_config(tmp_path / "setup.toml", values))])
    ref = reference_run(cfg)
    for r in range(ROUNDS):
        sizes = [ref.sizes[pid] for pid in ref.deltas[r]]
        assert len(set(sizes)) > 1, sizes
        masks = np.array(list(ref.masks[r].values()))
        assert len({tuple(m) for m in masks}) > 1, masks  # independent masks differ within the round
    sync = np.array([block_mask(synchronized_mask_seed(SEED, r), 2, KEEP) for r in range(1, ROUNDS + 1)])
    assert sync.any(axis=0).all() and (~sync).any(axis=0).all(), sync  # each block kept once, dropped once
    indep = np.array([m for masks in ref.masks for m in masks.values()])
    assert indep.any(axis=0).all() and (~indep).any(axis=0).all(), indep
    assert any(n < SHARD and n % MINIBATCH[0] for n in ref.sizes.values())  # a short last minibatch


def test_the_model_moves_against_the_gradient(tmp_path):
    """One full-batch unmasked round: θ_1 − θ_0 = −lr · Σ_k w_k ∇L_k(θ_0) (Δ_k = lr ∇L_k)."""
    cfg, run = local_run(tmp_path, "none", "weighted", "full", **{"num-rounds": 1})
    theta1 = run.theta
    ref = reference_run(cfg)
    theta0 = ref.thetas[0]
    sizes = {pid: ref.sizes[pid] for pid in ref.grads[0]}
    total = sum(sizes.values())
    grad = [sum(sizes[pid] / total * ref.grads[0][pid][blk] for pid in sizes) for blk in range(2)]
    for pid, delta in ref.deltas[0].items():  # the reference itself: Δ_k = lr ∇L_k(θ_0)
        for d, g in zip(delta, ref.grads[0][pid], strict=True):
            np.testing.assert_allclose(d, LR * g, rtol=1e-12, atol=1e-15)
    step = np.concatenate([(t1.astype(np.float64) - t0).ravel() for t1, t0 in zip(theta1, theta0, strict=True)])
    g = np.concatenate([x.ravel() for x in grad])
    cosine = float(step @ g) / (np.linalg.norm(step) * np.linalg.norm(g))
    assert cosine < -0.99999, cosine
    assert np.linalg.norm(step + LR * g) <= THETA_RTOL * np.linalg.norm(LR * g)


def test_clients_with_different_shards_give_different_updates(tmp_path):
    cfg, run = local_run(tmp_path, "none", "uniform", "full")
    ref = reference_run(cfg)
    for deltas in ref.deltas:
        flat = {pid: np.concatenate([d.ravel() for d in delta]) for pid, delta in deltas.items()}
        for i, j in itertools.combinations(flat, 2):
            assert np.linalg.norm(flat[i] - flat[j]) > 0.1 * np.linalg.norm(flat[i]), (i, j)
    for r in range(ROUNDS):  # in the run: not the K_c ceiling that identical updates give
        row = run.rows.iloc[r]
        assert row["recovery"] < COHORT * (1 - 1e-3) and row["sigma2_hat"] > 1e-3 * row["mean_sq_norm"], row


BUGS = {  # bug -> (configuration it shows in, a column the comparison must flag)
    "sign": (("none", "weighted", "full"), "theta"),
    "alias": (("none", "uniform", "full"), "recovery"),
    "no-rescale": (("independent", "weighted", "full"), "theta"),
    "double-rescale": (("synchronized", "uniform", "full"), "theta"),
    "shared-order": (("independent", "uniform", "minibatch"), "theta"),
    "no-shuffle": (("none", "weighted", "minibatch"), "theta"),
}


def test_the_comparison_rejects_broken_references(tmp_path):
    """The reference computed with each bug does not match the correct run: were the app to
    have the bug, the run would not match the correct reference either."""
    runs = {}
    for bug, (config, flagged) in BUGS.items():
        if config not in runs:
            runs[config] = cfg, run = local_run(tmp_path, *config)
            assert mismatches(run, reference_run(cfg)) == []
        cfg, run = runs[config]
        found = mismatches(run, reference_run(cfg, bug))
        assert any(flagged in f for f in found), (bug, found)
    aliased = reference_run(runs["none", "uniform", "full"][0], "alias")
    assert [row["recovery"] for row in aliased.rows] == pytest.approx([COHORT] * ROUNDS)


# ---------------------------------------------------------------- the real `flwr run`




FLOWER_CONFIGS = [
    ("synchronized", "uniform", "minibatch", "tensor"),
    ("none", "weighted", "full", "tensor"),
    ("independent", "weighted", "full", "coordinate"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mask_mode", "aggregation", "batch", "granularity"), FLOWER_CONFIGS, ids=["-".join(c) for c in FLOWER_CONFIGS]
)
def test_flower_run_matches_the_numpy_reference(flower, tmp_path, mask_mode, aggregation, batch, granularity):
    name = f"flwr-{mask_mode}-{aggregation}-{batch}-{granularity}"
    values = run_values(tmp_path, name, mask_mode, aggregation, *config_args(batch),
                        **{"mask-granularity": granularity})
    config = write_run_config(tmp_path / f"{name}.toml", values)
    cfg = load_run_config([str(config)])
    done = flower.run(config, NUM_CLIENTS)
    assert (cfg.run_dir / "checkpoint.pt").exists(), (done.stdout + done.stderr)[-5000:]
    assert mismatches(read_run(cfg), reference_run(cfg)) == []
