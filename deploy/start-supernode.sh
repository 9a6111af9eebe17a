#!/usr/bin/env bash
# Start one flower-supernode, detached, that trains on its own shard file (written by
# fedmask-export-shards) and authenticates with its key (deploy/add-supernode.sh NAME).
#   deploy/start-supernode.sh NAME SHARD_FILE RUNTIME_PORT [extra flower-supernode flags]
# RUNTIME_PORT: the SuperNode's own Runtime API port on 127.0.0.1 (one per SuperNode on a host).
# pid: $FEDMASK_DEPLOY_DIR/pids/supernode-NAME.pid   log: $FEDMASK_DEPLOY_DIR/logs/supernode-NAME.log
# With FEDMASK_FOREGROUND=1 it execs flower-supernode in the foreground instead: its exit status
# is the script's (1 when the SuperLink refuses the key; the log then says "Exit Code: 305").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need flower-supernode flower-superexec flwr-clientapp

[[ $# -ge 3 ]] || die "usage: deploy/start-supernode.sh NAME SHARD_FILE RUNTIME_PORT [flower-supernode flags]"
name=$1 shard=$2 runtime_port=$3; shift 3
[[ -f $shard ]] || die "shard file $shard not found (fedmask-export-shards OUT_DIR --run-config ...)"
shard=$(cd "$(dirname "$shard")" && pwd)/$(basename "$shard")   # the ClientApp needs an absolute path
[[ $shard != *\"* && $shard != *\ * ]] || die "shard path $shard must not contain quotes or spaces"
[[ -f $KEY_DIR/$name ]] || die "$KEY_DIR/$name missing: run deploy/add-supernode.sh $name first"
[[ -f $CERT_DIR/ca.crt ]] || die "$CERT_DIR/ca.crt missing: run deploy/make-certs.sh first"

cmd=(flower-supernode
    --superlink "$(superlink_address)"
    --root-certificates "$CERT_DIR/ca.crt"
    --auth-supernode-private-key "$KEY_DIR/$name"
    --node-config "data-path=\"$shard\""
    --host 127.0.0.1 --port "$runtime_port"
    "$@")

if [[ ${FEDMASK_FOREGROUND:-0} == 1 ]]; then
    port_free 127.0.0.1 "$runtime_port" || die "Runtime API port 127.0.0.1:$runtime_port is already in use"
    exec "${cmd[@]}"
fi
mkdir -p "$LOG_DIR"
if [[ -f $PID_DIR/supernode-$name.pid ]] && kill -0 "$(cat "$PID_DIR/supernode-$name.pid")" 2>/dev/null; then
    die "SuperNode $name is already running (pid $(cat "$PID_DIR/supernode-$name.pid")); deploy/stop.sh supernode-$name first"
fi
port_free 127.0.0.1 "$runtime_port" || die "Runtime API port 127.0.0.1:$runtime_port is already in use"
pid=$(start_detached "supernode-$name" "$LOG_DIR/supernode-$name.log" "${cmd[@]}")
# Up once its Runtime API listens; it then connects to the SuperLink (a refused key ends it).
if ! wait_port 127.0.0.1 "$runtime_port" "$FEDMASK_START_TIMEOUT" "$pid"; then
    tail -n 30 "$LOG_DIR/supernode-$name.log" >&2 || true
    "$(dirname "${BASH_SOURCE[0]}")/stop.sh" "supernode-$name" >/dev/null 2>&1 || true
    die "flower-supernode $name did not start (log above)"
fi
echo "SuperNode $name pid $pid, data-path $shard (log $LOG_DIR/supernode-$name.log)"
