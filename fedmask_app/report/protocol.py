"""What the runs did differently from the paper's protocol (PAPER.md, "The measurement protocol"),
as one short paragraph: fig1's title and the CLI's first line."""

from __future__ import annotations

import pandas as pd

from fedmask_app.report.runs import PAPER_ROUNDS, PAPER_WINDOW

PAPER_SEEDS, PAPER_TEST_IMAGES, PAPER_CLIENTS, PAPER_COHORT, PAPER_LR = 3, 10000, 100, 10, 0.01
MODEL_NOTES = {
    "resnet18-gn": "ResNet-18/GN with torchvision's ImageNet stem, 7×7/2 conv + max-pool",
    "resnet18-gn-cifar": "ResNet-18/GN with a 3×3/1 CIFAR stem, no max-pool",
    "cnn-fedavg": "the FedAvg paper's 2-conv CNN, not ResNet-18",
}
LOCAL_TRAINING = ("local training is plain SGD without momentum, weight decay or data augmentation (a project "
                  "choice, not matched to the paper's)")
AUGMENT_NOTES = {"crop-flip": "random 4-pixel-padded crops and horizontal flips"}


def _values(cells: pd.DataFrame, key: str) -> list:
    """The distinct values of a column, missing ones left out, in text order."""
    if key not in cells:
        return []
    values = {str(v): v for v in cells[key] if v is not None and not (isinstance(v, float) and v != v)}
    return [values[k] for k in sorted(values)]


def _join(values) -> str:
    return "/".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def protocol_deviations(cells: pd.DataFrame) -> list[str]:
    """Each way the cells' runs differ from the paper's protocol besides rounds and window: seeds,
    test subset, data set, model, precision, engine, shard cap, K, K_c, lr, aggregation, identical shards,
    training with masks or another server step, and the local training (always)."""
    out = []
    seeds = sorted(int(s) for s in cells["n_seeds"].unique()) if "n_seeds" in cells else []
    if seeds and seeds[0] < PAPER_SEEDS:
        span = f"{seeds[0]}" if seeds[0] == seeds[-1] else f"{seeds[0]}-{seeds[-1]}"
        out.append(f"{span} seed(s) per cell (paper {PAPER_SEEDS})")
    subsets = [s for s in _values(cells, "test-subset") if 0 < _number(s) < PAPER_TEST_IMAGES]
    if subsets:
        out.append(f"test accuracy on {_join(subsets)} of the {PAPER_TEST_IMAGES} test images")
    datasets = [d for d in _values(cells, "dataset") if str(d) != "cifar10"]
    if datasets:
        out.append(f"data set {_join(datasets)} (paper: CIFAR-10)")
    models = _values(cells, "model")
    if models:
        described = "; ".join(f"{m} ({MODEL_NOTES[str(m)]})" if str(m) in MODEL_NOTES else str(m) for m in models)
        out.append(f"model {described} (paper: ResNet-18/GN, stem not stated)")
    precision = [p for p in _values(cells, "precision") if str(p) != "float32"]
    if precision:
        out.append(f"precision {_join(precision)} (reference: float32)")
    engines = sorted({e for v in _values(cells, "engine") for e in str(v).split("/")})
    out.append(f"engine {_join(engines) or 'not recorded'}")
    caps = [c for c in _values(cells, "max-shard-size") if _number(c) > 0]
    if caps:
        out.append(f"shards capped at {_join(caps)} examples (max-shard-size; paper: uncapped)")
    for key, paper, text in (("num-clients", PAPER_CLIENTS, "K = {} clients"),
                             ("clients-per-round", PAPER_COHORT, "K_c = {} a round"), ("lr", PAPER_LR, "lr {}")):
        other = [v for v in _values(cells, key) if _number(v) != paper]
        if other:
            out.append(f"{text.format(_join(other))} (paper {paper:g})")
    if "uniform" in map(str, _values(cells, "aggregation")):
        out.append("uniform aggregation (paper: n_k-weighted)")
    if any(str(v).lower() == "true" for v in _values(cells, "identical-shards")):
        out.append("identical shards (the correctness control)")
    masks = [m for m in _values(cells, "mask-mode") if str(m) != "none"]
    if masks:
        out.append(f"trained with {_join(masks)} masks (the paper measures unmasked FedAvg training)")
    steps = [s for s in _values(cells, "server-step") if str(s) != "fedavg"]
    if steps:
        out.append(f"server step {_join(steps)} (paper: FedAvg)")
    out.append(local_training_note(cells))
    return out


def local_training_note(cells: pd.DataFrame) -> str:
    """LOCAL_TRAINING for plain SGD on the shards as stored, else the momentum, weight decay and data
    augmentation the runs used."""
    parts = []
    for key in ("momentum", "weight-decay"):
        used = [v for v in _values(cells, key) if _number(v) != 0]
        if used:
            parts.append(f"{key.replace('-', ' ')} {_join(used)}")
    augments = [str(a) for a in _values(cells, "augment") if str(a) != "none"]
    if augments:
        parts.append("augmentation " + "/".join(f"{a} ({AUGMENT_NOTES.get(a, a)})" for a in augments))
    if not parts:
        return LOCAL_TRAINING
    return f"local training is SGD with {' and '.join(parts)} (project default: plain SGD; the paper states lr only)"


def protocol_note(cells: pd.DataFrame) -> str:
    """"paper protocol: ..." or "reduced protocol: N rounds, window W ...", then "Differs from the
    paper: " and protocol_deviations."""
    rounds = sorted(cells["num_rounds"].unique())
    window = int(cells["window"].iloc[0])
    n = f"{rounds[0]}" if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
    if rounds[0] >= PAPER_ROUNDS and window == PAPER_WINDOW:
        head = f"paper protocol: {n} rounds, window {window}"
    else:
        start = max(1, int(rounds[-1]) - window + 1)
        covered = f"rounds {start}-{rounds[-1]}" if len(rounds) == 1 else f"each run's last {window} rounds"
        head = (f"reduced protocol: {n} rounds, window {window} ({covered}); "
                f"the paper's is {PAPER_ROUNDS} rounds, window {PAPER_WINDOW}")
    return f"{head}. Differs from the paper: {'; '.join(protocol_deviations(cells))}."
