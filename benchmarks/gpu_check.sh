#!/usr/bin/env bash
# The GPU check, run as is on a bare GPU machine from a copy of the repo tree (no install, no
# network, no flwr/ray): python3 with torch, torchvision, numpy, pandas, filelock; PYTHONPATH=.
#
#   bash benchmarks/gpu_check.sh                # on the GPU machine: meant to take about 8 minutes on one H200
#   bash benchmarks/gpu_check.sh --cpu-smoke    # the same steps, tiny, on a CPU (about a minute)
#
# Data: $FEDMASK_GPU_DATA_DIR, default .gpu-data/ (cifar10-subset.npz from benchmarks/gpu_subset.py;
# carry it with the tree). Steps: 1 imports without flwr/ray, 2 the data verify, 3 tests/test_cuda.py
# (control, repetition, CUDA graphs against eager, client streams against one by one, device-resident
# against host rounds, gemm-convs against cuDNN's convolutions, runs trained together, CUDA-vs-CPU
# drift), 4 benchmarks/gpu_timing.py on vec-graphs with and without gemm-convs, side by side, in bf16,
# tf32 and float32 (rounds per cell and path, each split into training and server step; their ratio;
# the protocol's projected time each way; the evaluation), 5 the bs-32 cell again with
# skip-padding-taps, 6 benchmarks/step_profile.py (one bs-32 step of the replayed paths in bf16 and
# tf32: wall against kernel time, kernels a step, the costliest kernels; each with and without
# gemm-convs and cuDNN's autotuner, the one-client step again channels-last), 7
# benchmarks/streams_graphs_hang.py (which float32 client-streams + cuda-graphs rounds hang). Measured
# on 2026-12-04 and no longer part of the check (docs/gpu): the sequential and eager vectorised paths
# and streams-graphs (slower than vec-graphs in every precision), runs trained together (--grouped),
# the server step on the device against the host (--residency both), 4 runs in threads (--threaded).
# The order is by weight: when the call's time runs out, the tail is what is lost.
# Every step runs, each under a time limit; the exit status is 1 when one failed.
# GPU_CHECK_CPU_SMOKE=1 is the same as --cpu-smoke.

set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # deterministic cuBLAS (float32)
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
DATA_DIR="${FEDMASK_GPU_DATA_DIR:-.gpu-data}"
export FEDMASK_GPU_DATA_DIR="$DATA_DIR"
SMOKE="${GPU_CHECK_CPU_SMOKE:-0}"
[[ "${1:-}" == "--cpu-smoke" ]] && SMOKE=1
FAILED=()

IMPORTS_PY='
import importlib, sys
modules = ["fedmask_app.engines.local", "fedmask_app.run.client_task", "fedmask_app.run.evaluation",
           "fedmask_app.run.measurements", "fedmask_app.run.loop", "clients.training", "clients.vectorized",
           "clients.masking", "clients.seeds", "strategies.aggregate", "strategies.cohort", "strategies.round",
           "strategies.stats", "strategies.server_step", "strategies.cohort_pass", "strategies.device_pass",
           "clients.cuda_graphs", "clients.streams"]
for name in modules:
    importlib.import_module(name)
pulled = sorted(m for m in sys.modules if m.split(".")[0] in ("flwr", "ray"))
print(f"imported {len(modules)} modules; flwr/ray modules pulled in: {pulled}")
sys.exit(1 if pulled else 0)
'

DATA_PY='
import sys
from pathlib import Path
from fedmask_app.run.data import dataset_sha256, load_dataset
data_dir = Path(sys.argv[1]).resolve()
data = load_dataset(data_dir)  # verifies the content sha256
print(f"{data_dir}: train {data.x_train.shape}, test {data.x_test.shape}, content sha256 {data.sha256}")
sys.exit(0 if dataset_sha256(data_dir) == data.sha256 else 1)
'

VERSIONS_PY='
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, cuda available {torch.cuda.is_available()}")
'

step() {  # step NAME TIMEOUT_S COMMAND...: run it under a time limit, report, remember a failure
    local name=$1 limit=$2 started rc
    shift 2
    echo "=== step: $name (at most ${limit} s)"
    started=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    if [[ $rc -eq 0 ]]; then
        echo "=== $name: ok ($(( $(date +%s) - started )) s)"
    else
        echo "=== $name: FAILED (exit $rc$([[ $rc -eq 124 ]] && echo ', timed out'), $(( $(date +%s) - started )) s)"
        FAILED+=("$name")
    fi
}

header() {
    local commit=""
    echo "=== gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC'), mode $([[ $SMOKE == 1 ]] && echo cpu-smoke || echo gpu)"
    command -v git >/dev/null && commit=$(git rev-parse HEAD 2>/dev/null)
    # A COMMIT file (git rev-parse HEAD > COMMIT before the tree is copied) wins: a copied tree's
    # .git, where there is one, need not match its files.
    if [[ -f COMMIT ]]; then echo "commit $(cat COMMIT) (COMMIT file)"
    elif [[ -n $commit ]]; then echo "commit $commit (git rev-parse HEAD)"
    else echo "commit unknown (no git repository, no COMMIT file)"; fi
    "$PY" -c "$VERSIONS_PY"
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L; fi
}

header
if [[ $SMOKE != 1 ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "=== gpu_check: FAILED, torch sees no CUDA device (on a CPU machine use --cpu-smoke)"
    exit 1
fi
step "imports without flwr/ray" 30 "$PY" -c "$IMPORTS_PY"
step "data" 30 "$PY" -c "$DATA_PY" "$DATA_DIR"
step "tests/test_cuda.py" 180 "$PY" tests/test_cuda.py
if [[ $SMOKE == 1 ]]; then
    step "benchmarks/step_profile.py" 120 "$PY" benchmarks/step_profile.py --device cpu --steps 1 --clients 2 \
        --paths sequential vectorised --top 3 --cudnn-benchmark --channels-last --gemm-convs --model cnn-fedavg
    step "benchmarks/gpu_timing.py --quick gemm-convs" 120 "$PY" benchmarks/gpu_timing.py --quick --device cpu \
        --data-dir "$DATA_DIR" --model cnn-fedavg --paths vectorised vectorised-gemm --precisions float32 bf16
    step "benchmarks/gpu_timing.py --quick" 240 "$PY" benchmarks/gpu_timing.py --quick --device cpu --data-dir "$DATA_DIR" \
        --concurrent 2 --threaded 2 --grouped 2 --grouped-chunked --eval-batch-sizes 100
    step "benchmarks/gpu_timing.py --quick --residency both" 120 "$PY" benchmarks/gpu_timing.py --quick --device cpu \
        --data-dir "$DATA_DIR" --paths vectorised --precisions float32 --residency both
    step "benchmarks/streams_graphs_hang.py" 120 "$PY" benchmarks/streams_graphs_hang.py --data-dir "$DATA_DIR" \
        --device cpu --cases 1
else
    # Most decisive first: if the call's time runs out, the tail is what is lost.
    # --budget-s skips the configurations left once that many seconds have passed; --config-cap-s ends
    # one configuration's timed rounds after that many seconds (at least one round is timed).
    # the fastest path (vec-graphs) with and without gemm-convs, side by side, every precision: under vmap
    # cuDNN ran the cohort's grouped convolutions group by group (2026-12-04's profile), gemm-convs
    # makes them one batched GEMM
    step "benchmarks/gpu_timing.py gemm-convs" 200 "$PY" benchmarks/gpu_timing.py --device cuda \
        --data-dir "$DATA_DIR" --paths vec-graphs vec-graphs-gemm --precisions bf16 tf32 float32 \
        --budget-s 150 --config-cap-s 3
    # skip-padding-taps on the launch-bound cell, both ways (compare with the lines above)
    step "benchmarks/gpu_timing.py --skip-padding-taps" 60 "$PY" benchmarks/gpu_timing.py --device cuda \
        --data-dir "$DATA_DIR" --cells bs32-tau2 --paths vec-graphs vec-graphs-gemm --precisions bf16 tf32 \
        --budget-s 35 --config-cap-s 4 --skip-padding-taps --test-images 2000
    # one bs-32 step of the replayed paths in bf16 and tf32: wall time against kernel time, kernels a step,
    # the costliest kernels; each again with gemm-convs and with cuDNN's autotuner; the one-client step
    # again in channels-last layout (candidates all: the engine leaves the last two off)
    step "benchmarks/step_profile.py" 150 "$PY" benchmarks/step_profile.py --device cuda --precision bf16 tf32 \
        --paths graphs vec-graphs --steps 10 --gemm-convs --channels-last --cudnn-benchmark --top 5
    # which float32 client-streams + cuda-graphs runs hang: streams, clients, a partial batch, determinism
    step "benchmarks/streams_graphs_hang.py" 240 "$PY" benchmarks/streams_graphs_hang.py --data-dir "$DATA_DIR" \
        --timeout-s 25
fi
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "=== gpu_check: FAILED steps: ${FAILED[*]}"
    exit 1
fi
echo "=== gpu_check: all steps passed"
