"""The local engine on CUDA (skipped without a CUDA device): the identical-shards control, bitwise
repetition (sequential, vectorised, CUDA graphs, client streams, gemm-convs), CUDA graphs against
the eager step, client streams against one client at a time, gemm-convs against cuDNN's
convolutions, rounds reduced on the device against rounds
reduced on the host, runs trained together (``--group-runs``) against each run alone, and how far
CUDA's numbers lie from the CPU's (printed: a measurement, not a bound).

Small configurations (20 clients, 4 a round, shards of 64 images, 200 test images) on the data
in $FEDMASK_GPU_DATA_DIR, else ``.gpu-data/`` (the subset benchmarks/gpu_subset.py writes), else
``../shared/data``. precision float32 is the default: TF32 off, deterministic algorithms
(fedmask_app/run/device.py). benchmarks/gpu_check.sh runs this file as a script, ``python
tests/test_cuda.py`` (the GPU machine may have no pytest); pytest runs it too.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch

try:
    import pytest
except ImportError:  # a bare GPU machine: run as a script, see main()
    pytest = None

import fedmask_app.engines.local as local
from fedmask_app.engines.local import run_local
from fedmask_app.engines.run_group import run_group
from fedmask_app.run.config import run_config_from_values
from fedmask_app.run.data import FILE_NAME, SUBSET_FILE_NAME

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR_ENV = "FEDMASK_GPU_DATA_DIR"
HAS_CUDA = torch.cuda.is_available()
RESIDENT_ON = local.resident_on
if pytest is not None:
    pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")

SMALL = {
    "num-clients": 20, "clients-per-round": 4, "max-shard-size": 64, "batch-size": 32, "local-epochs": 1,
    "test-subset": 200, "eval-every": 1, "checkpoint-every": 0, "device": "cuda", "precision": "float32",
}
COMPARED = ("recovery", "recovery_weighted", "sigma2_hat", "train_loss", "test_loss", "test_accuracy")
# (device, precision, vectorize), each against CUDA float32 sequential
DRIFT_RUNS = (("cpu", "float32", False), ("cuda", "float32", True), ("cuda", "tf32", False), ("cuda", "bf16", False))


def data_dir() -> Path:
    """The first folder of $FEDMASK_GPU_DATA_DIR, .gpu-data/, ../shared/data that holds data."""
    candidates = [os.environ.get(DATA_DIR_ENV, ""), str(ROOT / ".gpu-data"), str(ROOT.parent / "shared" / "data")]
    for candidate in filter(None, candidates):
        if any((Path(candidate) / name).is_file() for name in (SUBSET_FILE_NAME, FILE_NAME)):
            return Path(candidate).resolve()
    raise FileNotFoundError(f"no {SUBSET_FILE_NAME} or {FILE_NAME} in any of {candidates}: carry .gpu-data/")


def run(out: Path, name: str, **values) -> tuple[pd.DataFrame, list[np.ndarray]]:
    """A small local-engine run (kebab-case ``values`` override SMALL): its rounds.csv and final θ."""
    cfg = run_config_from_values(
        {**SMALL, "data-dir": str(data_dir()), "output-dir": str(out), "run-name": name, **values}
    )
    params = run_local(cfg, echo=lambda _: None)
    rows = pd.read_csv(cfg.run_dir / "rounds.csv")
    assert (rows["num_failures"] == 0).all(), f"{name}: a client failed"
    return rows, params


PATHS = {"sequential": {}, "vectorised": {"vectorize": True}, "graphs": {"cuda-graphs": True},
         "vectorised-graphs": {"vectorize": True, "cuda-graphs": True}, "live-taps": {"skip-padding-taps": True},
         "streams": {"client-streams": 3}, "streams-graphs": {"client-streams": 3, "cuda-graphs": True},
         "vectorised-graphs-gemm": {"vectorize": True, "cuda-graphs": True, "gemm-convs": True}}


def test_identical_shards_control_gives_the_ceiling_on_cuda(tmp_path: Path) -> None:
    for path, values in PATHS.items():
        rows, _ = run(tmp_path, f"control-{path}", **{"identical-shards": True, "num-rounds": 2, **values})
        ratios = rows[["recovery", "recovery_weighted"]].to_numpy()
        np.testing.assert_allclose(ratios, SMALL["clients-per-round"], rtol=1e-6, err_msg=path)


def test_cuda_graphs_replay_the_eager_step(tmp_path: Path) -> None:
    """cuda-graphs = true replays the eager path's kernels, sequential or vectorised (with momentum
    too: its buffers live in the graph and start at zero each round; with gemm-convs too): the same
    rows and θ. Prints how far they lie apart (0 when bitwise equal); asserts round 1 within 1e-5
    relative."""
    for path, values, precisions in (("sequential", {}, ("float32", "bf16")),
                                     ("vectorised", {"vectorize": True}, ("float32", "bf16")),
                                     ("vectorised-momentum", {"vectorize": True, "momentum": 0.9}, ("float32",)),
                                     ("vectorised-gemm", {"vectorize": True, "gemm-convs": True}, ("float32", "bf16"))):
        for precision in precisions:
            common = {"num-rounds": 3, "precision": precision, "max-shard-size": 80,  # 2 full batches + 16
                      **values}
            (eager, theta_e), (graphed, theta_g) = (
                run(tmp_path, f"graphs{int(g)}-{path}-{precision}", **common, **{"cuda-graphs": g})
                for g in (False, True)
            )
            compare_runs(f"{path} {precision}: cuda-graphs vs eager", (eager, theta_e), (graphed, theta_g), 1e-5)


def test_the_same_seed_twice_gives_identical_rows_on_cuda(tmp_path: Path) -> None:
    for path, values in PATHS.items():
        (a, theta_a), (b, theta_b) = (run(tmp_path, f"repeat{i}-{path}", **{"num-rounds": 3, **values}) for i in (1, 2))
        timing = [c for c in a.columns if c.endswith("seconds")]
        pd.testing.assert_frame_equal(a.drop(columns=timing), b.drop(columns=timing), check_exact=True)
        assert all(np.array_equal(x, y) for x, y in zip(theta_a, theta_b, strict=True)), path


def test_client_streams_give_the_sequential_rows(tmp_path: Path) -> None:
    """client-streams = 3 (4 clients a round: one replica trains two) runs each client's own
    kernels, side by side: the rows and θ of the one-by-one path, eager and with CUDA graphs.
    Prints how far they lie apart, then asserts bitwise equality."""
    for graphs in (False, True):
        common = {"num-rounds": 3, "max-shard-size": 80, "cuda-graphs": graphs}  # 2 full batches + 16
        (one, theta_one), (side, theta_side) = (
            run(tmp_path, f"streams{n}-graphs{int(graphs)}", **common, **{"client-streams": n}) for n in (1, 3)
        )
        label = f"client-streams 3 vs 1{' (cuda-graphs)' if graphs else ''}"
        compare_runs(label, (one, theta_one), (side, theta_side), 1e-6)
        timing = [c for c in one.columns if c.endswith("seconds")]
        pd.testing.assert_frame_equal(one.drop(columns=timing), side.drop(columns=timing), check_exact=True)
        assert all(np.array_equal(x, y) for x, y in zip(theta_one, theta_side, strict=True)), label


def test_device_resident_rounds_are_the_host_rounds(tmp_path: Path) -> None:
    """θ and Δ_k on the GPU, reduced there (the engine's default on CUDA), against replies copied to
    the host and reduced with numpy: the same local training, only the server pass's float64
    summation order differs. Prints the worst difference over 3 rounds; asserts round 1 within 1e-6."""
    for path in ("sequential", "vectorised"):
        runs = []
        for resident in (True, False):
            local.resident_on = lambda _device, resident=resident: resident
            try:
                runs.append(run(tmp_path, f"resident{int(resident)}-{path}", **{"num-rounds": 3, **PATHS[path]}))
            finally:
                local.resident_on = RESIDENT_ON
        compare_runs(f"{path}: device-resident vs host rounds", runs[1], runs[0], 1e-6)


def test_gemm_convs_give_cudnns_rows(tmp_path: Path) -> None:
    """gemm-convs (convolutions as matrix products) against cuDNN's convolutions, float32, one client
    at a time and vectorised: the same function summed in another order (equal within 1e-10 in
    float64: tests/test_gemm_convs.py, tests/test_vectorized.py). Prints how far the rows and θ lie
    apart over 3 rounds; asserts round 1 within 1e-2, a bound against a wrong computation, not
    float32 noise: these small runs amplify rounding (on the 2-core CPU, 2 rounds, 1/dS moved
    1.2e-3 with gemm-convs and 3.5e-4 with oneDNN off, another convolution algorithm)."""
    for path, values in (("sequential", {}), ("vectorised", {"vectorize": True})):
        common = {"num-rounds": 3, "max-shard-size": 80, **values}
        (cudnn, theta_c), (gemm, theta_g) = (run(tmp_path, f"gemm{int(g)}-{path}", **common, **{"gemm-convs": g})
                                             for g in (False, True))
        compare_runs(f"{path}: gemm-convs vs cuDNN's convolutions", (cudnn, theta_c), (gemm, theta_g), 1e-2)


def run_together(out: Path, names: list[str], chunk_clients: int | None = None, **values
                 ) -> list[tuple[pd.DataFrame, list[np.ndarray]]]:
    """Small runs trained together (engines/run_group.py), seeds 0, 1, ...: each one's rounds.csv
    and final θ (from its checkpoint)."""
    cfgs = [run_config_from_values({**SMALL, "data-dir": str(data_dir()), "output-dir": str(out), "run-name": name,
                                    "vectorize": True, "seed": seed, "checkpoint-every": values["num-rounds"],
                                    **values})
            for seed, name in enumerate(names)]
    errors = run_group(cfgs, [lambda _: None] * len(cfgs), chunk_clients)
    assert errors == [None] * len(cfgs), errors
    results = []
    for cfg in cfgs:
        rows = pd.read_csv(cfg.run_dir / "rounds.csv")
        theta = [t.numpy() for t in torch.load(cfg.run_dir / "checkpoint.pt", weights_only=True)["params"]]
        results.append((rows, theta))
    return results


def test_runs_trained_together_on_cuda(tmp_path: Path) -> None:
    """Two runs trained together (fedmask-sweep --group-runs): the identical-shards control gives
    K_c; with cuda-graphs the eager group's rows (round 1 within 1e-5), also with the group's 8
    clients vmapped in chunks of one cohort under the one graph; and each run's rows lie within
    5e-4 of its vectorised run alone in round 1 (10x the CPU-vs-CUDA difference of 1/dS measured on
    an H200, README), the differences printed."""
    for rows, _ in run_together(tmp_path, ["control-0", "control-1"], **{"identical-shards": True, "num-rounds": 2}):
        np.testing.assert_allclose(rows[["recovery", "recovery_weighted"]].to_numpy(), SMALL["clients-per-round"],
                                   rtol=1e-6)
    common = {"num-rounds": 3, "max-shard-size": 80}  # 2 full batches + 16
    eager = run_together(tmp_path, ["group-0", "group-1"], **common)
    graphed = run_together(tmp_path, ["group-graphs-0", "group-graphs-1"], **common, **{"cuda-graphs": True})
    chunked = run_together(tmp_path, ["group-chunked-0", "group-chunked-1"], chunk_clients=SMALL["clients-per-round"],
                           **common, **{"cuda-graphs": True})
    for seed in (0, 1):
        compare_runs(f"run {seed} trained together: cuda-graphs vs eager", eager[seed], graphed[seed], 1e-5)
        compare_runs(f"run {seed} trained together: cuda-graphs in vmap chunks of one cohort vs eager", eager[seed],
                     chunked[seed], 5e-4)
        alone = run(tmp_path, f"alone-{seed}", seed=seed, vectorize=True, **common)
        compare_runs(f"run {seed}: trained together vs alone (vectorised)", alone, eager[seed], 5e-4)


def compare_runs(label: str, reference: tuple[pd.DataFrame, list[np.ndarray]],
                 other: tuple[pd.DataFrame, list[np.ndarray]], first_round_tolerance: float) -> None:
    """Print the worst relative difference of the COMPARED columns over all rounds and of θ;
    assert round 1's within ``first_round_tolerance``."""
    (rows, theta), (other_rows, other_theta) = reference, other
    worst = max(relative(float(a), float(b)) for c in COMPARED for a, b in zip(rows[c], other_rows[c], strict=True))
    print(f"\n{label}, {len(rows)} rounds: worst relative row difference {worst:.2e}, "
          f"theta {theta_relative(theta, other_theta):.2e}")
    first = [relative(float(rows[c].iloc[0]), float(other_rows[c].iloc[0])) for c in COMPARED]
    assert max(first) <= first_round_tolerance, f"{label}: round 1 differs by {max(first):.2e}"


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(a) if a == a and a != 0 else float("nan")


def theta_relative(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """‖a − b‖ / ‖a‖ over all parameters, in float64."""
    num = sum(float(np.sum((x.astype(np.float64) - y) ** 2)) for x, y in zip(a, b, strict=True))
    return (num / sum(float(np.sum(x.astype(np.float64) ** 2)) for x in a)) ** 0.5


def drift_runs(out: Path) -> dict[tuple[str, str, bool], dict[int, tuple[pd.Series, list[np.ndarray]]]]:
    """Rows and θ after 1 and after 5 rounds, per (device, precision, vectorize)."""
    runs = {}
    for device, precision, vectorize in (("cuda", "float32", False), *DRIFT_RUNS):
        key = (device, precision, vectorize)
        runs[key] = {}
        for rounds in (1, 5):
            rows, theta = run(out, f"{device}-{precision}-v{int(vectorize)}-r{rounds}", device=device,
                              precision=precision, vectorize=vectorize, **{"num-rounds": rounds})
            runs[key][rounds] = (rows.iloc[-1], theta)
    return runs


def test_cuda_and_cpu_rows_differ_by(tmp_path: Path) -> None:
    """Prints the relative differences (a measurement, not a bound); asserts only finite numbers."""
    runs = drift_runs(tmp_path)
    reference = runs[("cuda", "float32", False)]
    print("\nrelative difference from CUDA float32, sequential (a measurement, not a bound):")
    print(f"{'run':24s} {'round':>5s} " + " ".join(f"{c:>17s}" for c in COMPARED) + f" {'theta':>10s}")
    for key in DRIFT_RUNS:
        for rounds in (1, 5):
            (ref_row, ref_theta), (row, theta) = reference[rounds], runs[key][rounds]
            diffs = [relative(float(ref_row[c]), float(row[c])) for c in COMPARED]
            label = f"{key[0]} {key[1]} {'vectorised' if key[2] else 'sequential'}"
            print(f"{label:24s} {rounds:5d} " + " ".join(f"{d:17.2e}" for d in diffs)
                  + f" {theta_relative(ref_theta, theta):10.2e}")
    for key, by_rounds in runs.items():
        for row, _ in by_rounds.values():
            assert np.isfinite(float(row["recovery"])), f"{key}: 1/ΔS is not finite"


TESTS: tuple[Callable[[Path], None], ...] = (
    test_identical_shards_control_gives_the_ceiling_on_cuda,
    test_the_same_seed_twice_gives_identical_rows_on_cuda,
    test_cuda_graphs_replay_the_eager_step,
    test_client_streams_give_the_sequential_rows,
    test_device_resident_rounds_are_the_host_rounds,
    test_gemm_convs_give_cudnns_rows,
    test_runs_trained_together_on_cuda,
    test_cuda_and_cpu_rows_differ_by,
)


def main() -> int:
    """Run every test without pytest; exit status 1 when one failed."""
    if not HAS_CUDA:
        print("tests/test_cuda.py: SKIPPED (no CUDA device)")
        return 0
    print(f"tests/test_cuda.py on {torch.cuda.get_device_name()}, data {data_dir()}", flush=True)
    failed = 0
    for test in TESTS:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="fedmask-cuda-") as tmp:
            try:
                test(Path(tmp))
                print(f"PASSED {test.__name__} ({time.perf_counter() - started:.0f} s)", flush=True)
            except Exception:  # report every test, then fail
                traceback.print_exc()
                print(f"FAILED {test.__name__} ({time.perf_counter() - started:.0f} s)", flush=True)
                failed += 1
    print(f"tests/test_cuda.py: {len(TESTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
