"""client-streams: the cohort's clients side by side (clients/streams.py). On a CPU there are no
streams, so these tests check everything else: each client's update is the one ``local_update``
gives it, the replicas share the cohort in turn, and a run writes the one-by-one run's rows bit
for bit, faulty clients included. tests/test_cuda.py compares the two on a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from clients.streams import StreamedClients
from clients.training import LocalTraining, SGDStep, local_update
from fedmask_app.engines import local
from fedmask_app.engines.local import local_train_round, run_local, side_by_side
from fedmask_app.run.client_task import ClientTask
from fedmask_app.run.config import ConfigError, refuse_local_engine_keys, run_config_from_values
from fedmask_app.run.device import streams_graphs_float32_warning
from fedmask_app.run.loop import run_rounds
from strategies.cohort import sample_cohort

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.GroupNorm(2, 8), nn.ReLU(), nn.Linear(8, 3))


def test_each_client_gets_its_local_update_and_the_replicas_take_turns():
    model = _model()
    theta = [p.detach().numpy().copy() for p in model.parameters()]
    training = LocalTraining(epochs=2, batch_size=4, lr=0.1)
    shards = [(torch.randn(n, 5), torch.randint(0, 3, (n,))) for n in (9, 4, 1, 12, 6)]  # partial batches too
    seen: list[tuple[int, int]] = []  # (replica index, batch size) of every step taken
    seen_replicas: list[nn.Module] = []

    def counting_step(replica: nn.Module):
        step = SGDStep(replica, training)
        index = len(seen_replicas)
        seen_replicas.append(replica)

        def take(images, labels):
            seen.append((index, len(labels)))
            return step(images, labels)

        return take

    streamed = StreamedClients(model, training, num_streams=2, make_step=counting_step)
    assert streamed.replicas[0] is model and streamed.replicas[1] is not model and streamed.streams is None
    results = streamed.local_updates(theta, shards, [torch.Generator().manual_seed(10 + k) for k in range(5)])
    reference = _model()
    for k, ((images, labels), result) in enumerate(zip(shards, results, strict=True)):
        want = local_update(reference, theta, images, labels, training, torch.Generator().manual_seed(10 + k))
        for a, b in zip(want.update, result.update, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert (result.train_loss, result.num_examples) == (want.train_loss, want.num_examples)
    steps = {n: 2 * -(-n // 4) for n in (9, 4, 1, 12, 6)}  # τ · ceil(n_k / bs)
    # cohort positions 0, 2, 4 train on replica 0 and 1, 3 on replica 1, each client's steps in a row
    assert [r for r, _ in seen] == [0] * steps[9] + [1] * steps[4] + [0] * steps[1] + [1] * steps[12] + [0] * steps[6]
    assert sum(size for _, size in seen) == 2 * sum(len(y) for _, y in shards)


def test_bad_stream_counts_and_engines_are_refused_by_name():
    with pytest.raises(ValueError, match="num_streams must be >= 1, got 0"):
        StreamedClients(_model(), LocalTraining(epochs=1, batch_size=4, lr=0.1), num_streams=0)
    with pytest.raises(ConfigError, match=r"client-streams = 2 is a local-engine key"):
        refuse_local_engine_keys(run_config_from_values({"client-streams": 2}))
    for values in ({"client-streams": 0}, {"client-streams": 2, "device": "cpu"},
                   {"client-streams": 2, "vectorize": True}):
        with pytest.raises(ConfigError, match=rf"client-streams = {values['client-streams']} is not allowed"):
            run_config_from_values(values)


def test_the_local_engine_refuses_streams_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "pick_device", lambda _cfg: torch.device("cpu"))
    cfg = run_config_from_values({"client-streams": 4, "output-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"client-streams = 4 needs a CUDA device; this run would train on cpu"):
        run_local(cfg, echo=lambda _: None)


def test_float32_streams_with_cuda_graphs_on_cuda_warn_of_the_measured_hang():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    hung = {"client-streams": 10, "cuda-graphs": True}
    message = streams_graphs_float32_warning(run_config_from_values(hung), cuda)
    assert message is not None and "client-streams = 10 with cuda-graphs = true in float32 hung" in message
    assert "docs/gpu/README.md" in message
    for values, device in (({**hung, "precision": "tf32"}, cuda), ({**hung, "precision": "bf16"}, cuda),
                           ({**hung, "cuda-graphs": False}, cuda), ({"client-streams": 1, "cuda-graphs": True}, cuda),
                           ({"vectorize": True, "cuda-graphs": True}, cuda), ({"cuda-graphs": True}, cpu)):
        assert streams_graphs_float32_warning(run_config_from_values(values), device) is None, values


@pytest.mark.parametrize("resident", [False, True])
def test_a_streamed_run_writes_the_one_by_one_runs_rows(tmp_path, resident):
    """5 clients a round on 2 replicas, unequal shards with partial batches, a client whose update
    is NaN and one that raises: rows.csv and θ equal the one-by-one run's bit for bit (float32,
    one thread); ``resident``: θ and Δ_k as tensors, reduced by the torch pass, as on a GPU."""
    cohorts = [sample_cohort(0, r, list(range(1500)), 5) for r in (1, 2)]
    faults = f"nan:{cohorts[0][3]}:1,raise:{cohorts[1][0]}:2"
    runs = {}
    for streams in (1, 2):
        cfg = run_config_from_values({
            "num-clients": 1500, "clients-per-round": 5, "num-rounds": 2, "local-epochs": 2, "batch-size": 16,
            "max-shard-size": 40, "test-subset": 100, "checkpoint-every": 0, "threads": 1, "alpha": 10.0,
            "min-partition-size": 5, "inject-fault": faults, "client-streams": streams,
            "data-dir": str(SHARED_DATA), "output-dir": str(tmp_path), "run-name": f"streams{streams}",
        })
        task = ClientTask(cfg, resident=resident)
        train = side_by_side(task) if streams > 1 else local.one_by_one(task)
        params = run_rounds(cfg, local.engine_name(cfg), local_train_round(cfg, train), echo=lambda _: None)
        runs[streams] = (pd.read_csv(cfg.run_dir / "rounds.csv"), params)
    (one, theta_one), (two, theta_two) = runs[1], runs[2]
    assert one["num_failures"].tolist() == [1, 1]
    timing = [c for c in one.columns if c.endswith("seconds")]
    pd.testing.assert_frame_equal(one.drop(columns=timing), two.drop(columns=timing), check_exact=True)
    assert all(np.array_equal(a, b) for a, b in zip(theta_one, theta_two, strict=True))
    shards = pd.read_csv(tmp_path / "streams2" / "shards.csv")["num_examples"]
    assert shards.min() < 40 and (shards % 16 != 0).any()  # unequal shards, partial last batches


@pytest.mark.parametrize(("values", "message"), [
    (["client-streams=3"], "client-streams = 3 needs a CUDA device"),
    (["cuda-graphs=true"], "cuda-graphs = true needs a CUDA device; this run would train on cpu"),
    (["inject-fault='hang:1:1'"], "inject-fault 'hang' needs the Flower engine"),
    (["vectorize=true", "inject-fault='nan:1:1'"], "inject-fault needs vectorize = false"),
])
def test_fedmask_local_refuses_what_it_cannot_run_here_by_name(tmp_path, monkeypatch, capsys, values, message):
    """Exit status 2, the reason on stderr, no traceback and no results folder."""
    from fedmask_app.cli import local as cli

    monkeypatch.setattr(local, "pick_device", lambda _cfg: torch.device("cpu"))
    assert cli.main([*values, f"output-dir='{tmp_path}'", "run-name='refused'"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_fedmask_run_refuses_cuda_graphs_when_its_simulated_clients_have_no_cuda(tmp_path, monkeypatch, capsys):
    """Every client would fail in the simulation: refused by name before Flower starts (exit 2)."""
    from fedmask_app.cli import run as fedmask_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fedmask_run, "run_with_flower", lambda *a, **k: pytest.fail("Flower was started"))
    assert fedmask_run.main(["cuda-graphs=true", f"output-dir='{tmp_path}'"]) == 2
    assert "cuda-graphs = true needs a CUDA device" in capsys.readouterr().err


def test_fedmask_sweep_refuses_cuda_graphs_when_this_machine_has_no_cuda(tmp_path, monkeypatch, capsys):
    from fedmask_app.cli import sweep

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    grid = tmp_path / "grid.toml"
    grid.write_text("[base]\nnum-rounds = 1\n[axes]\nseed = [0, 1]\n")
    assert sweep.main([str(grid), "--engine", "local", "--output-dir", str(tmp_path / "out"), "cuda-graphs=true"]) == 2
    assert "cuda-graphs = true needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
