"""fedmask-export-shards: write each client's shard of a run configuration to its own file.

A real device (a ``flower-supernode``) gets one of these files through its node config,
``--node-config 'data-path="/abs/shard-<id>.npz"'``; the ClientApp then trains on exactly the
shard the simulation and the local engine give that partition id. The files depend only on the
keys that define the partition (seed, num-clients, alpha, min-partition-size, max-shard-size,
identical-shards)
and the data set, which ``shards.json`` records next to them.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fedmask_app.cli.common import add_run_config_arguments, run_config_from_args
from fedmask_app.deploy.shards import partition_config, write_shard_file
from fedmask_app.run.client_task import client_shards
from fedmask_app.run.config import RunConfig
from fedmask_app.run.data import DataError, load_dataset, resolve_data_dir
from fedmask_app.run.files import atomic_write_json

MANIFEST = "shards.json"


def shard_file_name(partition_id: int) -> str:
    return f"shard-{partition_id}.npz"


def indices_sha256(indices: np.ndarray) -> str:
    """sha256 of a shard's training-set indices (int64, little-endian), in shard order."""
    return hashlib.sha256(np.ascontiguousarray(indices, dtype="<i8").tobytes()).hexdigest()


def export_shards(cfg: RunConfig, out_dir: Path, echo=print) -> dict[str, Any]:
    """Write ``shard-<id>.npz`` for every partition id of ``cfg`` and ``shards.json``; return the manifest."""
    out_dir = Path(out_dir).expanduser().resolve()
    data = load_dataset(resolve_data_dir(cfg.data_dir), cfg.dataset)  # verified against its content sha256
    shards = client_shards(cfg, data.y_train)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for partition_id, indices in enumerate(shards):
        path = out_dir / shard_file_name(partition_id)
        write_shard_file(path, partition_id, data.x_train[indices], data.y_train[indices], cfg)
        counts = np.bincount(data.y_train[indices], minlength=data.spec.num_classes)
        entries.append({
            "partition-id": partition_id,
            "file": path.name,
            "size": len(indices),
            "indices-sha256": indices_sha256(indices),
            "label-counts": [int(c) for c in counts],
        })
        echo(f"[fedmask] {path}  partition {partition_id}: {len(indices)} images")
    manifest = {
        "config": partition_config(cfg),
        "data-sha256": data.sha256,
        "num-partitions": len(shards),
        "partitions": entries,
        "node-config": "data-path=\"<absolute path of shard-<id>.npz>\"",
    }
    atomic_write_json(out_dir / MANIFEST, manifest)
    current = {entry["file"] for entry in entries}
    for stale in sorted(out_dir.glob("shard-*.npz")):  # from an earlier export with more clients
        if stale.name not in current and re.fullmatch(r"shard-\d+\.npz", stale.name):
            stale.unlink()
            echo(f"[fedmask] removed {stale} (not a partition of this configuration)")
    echo(f"[fedmask] {out_dir / MANIFEST}")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedmask-export-shards",
        description="Write OUT_DIR/shard-<id>.npz (one per client of the run config) and OUT_DIR/shards.json, "
        "for SuperNodes started with --node-config 'data-path=\"OUT_DIR/shard-<id>.npz\"'.",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="folder for the shard files")
    add_run_config_arguments(parser)
    args = parser.parse_intermixed_args(argv)
    cfg = run_config_from_args("fedmask-export-shards", args)
    if cfg is None:
        return 2
    if args.out_dir.exists() and not args.out_dir.is_dir():
        print(f"fedmask-export-shards: {args.out_dir} exists and is not a folder", file=sys.stderr)
        return 2
    try:
        export_shards(cfg, args.out_dir)
    except (DataError, ValueError, OSError) as exc:
        print(f"fedmask-export-shards: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
