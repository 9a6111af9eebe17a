"""One Flower simulation across a Ray cluster (`fedmask-run --ray-address`), on two loopback nodes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from flwr_runner import SHARED_DATA, write_run_config

from fedmask_app.cli import run as fedmask_run
from fedmask_app.engines.local import run_local
from fedmask_app.run.config import load_run_config

pytestmark = pytest.mark.slow


def test_a_simulation_on_a_two_node_cluster_writes_the_single_machine_rows(tmp_path):
    """Two nodes of 1 CPU each and 1 CPU per virtual client: Flower's pool (one actor per CPU of
    the cluster) can only place its two actors one on each node, so clients run on both. The rows
    equal a single-process run's (one thread per client in both)."""
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        values = {
            "model": "linear-softmax", "num-clients": 10, "clients-per-round": 4, "num-rounds": 2,
            "max-shard-size": 32, "local-epochs": 1, "batch-size": 8, "test-subset": 200, "checkpoint-every": 0,
            "threads": 1, "mask-mode": "independent", "data-dir": str(SHARED_DATA), "output-dir": str(tmp_path),
            "run-name": "cluster",
        }
        config = write_run_config(tmp_path / "cluster.toml", values)
        assert fedmask_run.main([str(config), "--ray-address", cluster.address]) == 0
        # This test never connects to the cluster itself: a driver in the cluster's log is the simulation's.
        gcs_log = Path(cluster.head_node.get_session_dir_path()) / "logs" / "gcs_server.out"
        assert "driver_pid=" in gcs_log.read_text(), "the simulation did not join the cluster"
        assert len(cluster.list_all_nodes()) == 2
    finally:
        cluster.shutdown()
    run_local(load_run_config([str(write_run_config(tmp_path / "local.toml", {**values, "run-name": "local"}))]),
              echo=lambda _: None)
    on_cluster = pd.read_csv(tmp_path / "cluster" / "rounds.csv").drop(columns="seconds")
    local = pd.read_csv(tmp_path / "local" / "rounds.csv").drop(columns="seconds")
    pd.testing.assert_frame_equal(on_cluster, local)
