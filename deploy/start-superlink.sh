#!/usr/bin/env bash
# Start flower-superlink with TLS and SuperNode authentication, detached, on
# $FEDMASK_SUPERLINK_HOST:$FEDMASK_SUPERLINK_PORT (one HTTP address for the Fleet, Control and
# Runtime APIs), and write the SuperLink connection into $FLWR_HOME/config.toml.
#   deploy/start-superlink.sh [extra flower-superlink flags]
# pid: $FEDMASK_DEPLOY_DIR/pids/superlink.pid   log: $FEDMASK_DEPLOY_DIR/logs/superlink.log
# Isolation is flower-superlink's default, `subprocess`: the SuperLink itself launches a
# flower-superexec child that runs each ServerApp (flwr-serverapp) -- no other process to start.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need flower-superlink flower-superexec flwr-serverapp python

for f in ca.crt server.pem server.key; do
    [[ -f $CERT_DIR/$f ]] || die "$CERT_DIR/$f missing: run deploy/make-certs.sh first"
done
mkdir -p "$LOG_DIR" "$FEDMASK_DEPLOY_DIR/state"
if [[ -f $PID_DIR/superlink.pid ]] && kill -0 "$(cat "$PID_DIR/superlink.pid")" 2>/dev/null; then
    die "the SuperLink is already running (pid $(cat "$PID_DIR/superlink.pid")); deploy/stop.sh superlink first"
fi
port_free "$FEDMASK_SUPERLINK_HOST" "$FEDMASK_SUPERLINK_PORT" || die "$(superlink_address) is already in use"

# The ServerApp writes the results into the run-config output-dir: give an absolute one.
pid=$(start_detached superlink "$LOG_DIR/superlink.log" \
    flower-superlink \
    --ssl-ca-certfile "$CERT_DIR/ca.crt" \
    --ssl-certfile "$CERT_DIR/server.pem" \
    --ssl-keyfile "$CERT_DIR/server.key" \
    --enable-supernode-auth \
    --disable-runtime-dependency-installation \
    --database "$FEDMASK_DEPLOY_DIR/state/superlink.db" \
    --host "$FEDMASK_SUPERLINK_HOST" --port "$FEDMASK_SUPERLINK_PORT" \
    "$@")

if ! wait_port "$FEDMASK_SUPERLINK_HOST" "$FEDMASK_SUPERLINK_PORT" "$FEDMASK_START_TIMEOUT" "$pid"; then
    tail -n 30 "$LOG_DIR/superlink.log" >&2 || true
    "$(dirname "${BASH_SOURCE[0]}")/stop.sh" superlink >/dev/null 2>&1 || true
    die "flower-superlink did not come up on $(superlink_address) within ${FEDMASK_START_TIMEOUT}s (log above)"
fi
echo "SuperLink pid $pid on https://$(superlink_address) (log $LOG_DIR/superlink.log)"

"$(dirname "${BASH_SOURCE[0]}")/write-federation.sh"
