# Sourced by the deploy scripts: settings (all overridable from the environment) and helpers.
# shellcheck shell=bash

FEDMASK_DEPLOY_DIR="${FEDMASK_DEPLOY_DIR:-$HOME/.fedmask-deploy}"   # certs/, keys/, pids/, logs/, state
FEDMASK_SUPERLINK_HOST="${FEDMASK_SUPERLINK_HOST:-127.0.0.1}"
FEDMASK_SUPERLINK_PORT="${FEDMASK_SUPERLINK_PORT:-9443}"
FEDMASK_FEDERATION="${FEDMASK_FEDERATION:-fedmask-tls}"              # [superlink.<name>] in $FLWR_HOME/config.toml
FEDMASK_START_TIMEOUT="${FEDMASK_START_TIMEOUT:-60}"                  # seconds to wait for a process to come up
FEDMASK_STOP_TIMEOUT="${FEDMASK_STOP_TIMEOUT:-20}"                    # seconds between SIGTERM and SIGKILL

CERT_DIR="$FEDMASK_DEPLOY_DIR/certs"
KEY_DIR="$FEDMASK_DEPLOY_DIR/keys"
PID_DIR="$FEDMASK_DEPLOY_DIR/pids"
LOG_DIR="$FEDMASK_DEPLOY_DIR/logs"

# Nothing installs the app's dependencies at run time (no `uv sync` of torch from a registry): the
# environment that runs these scripts already has fedmask installed. No update check either.
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_DISABLE_UPDATE_CHECK=1

die() { echo "$(basename "$0"): $*" >&2; exit 1; }

need() {
    local cmd
    for cmd in "$@"; do
        command -v "$cmd" >/dev/null 2>&1 || die "'$cmd' not found on PATH (activate the fedmask environment first)"
    done
}

superlink_address() { echo "$FEDMASK_SUPERLINK_HOST:$FEDMASK_SUPERLINK_PORT"; }

# wait_port HOST PORT SECONDS PID: until something accepts on HOST:PORT; fails early when PID dies.
wait_port() {
    local host=$1 port=$2 seconds=$3 pid=$4 deadline=$((SECONDS + $3))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || return 2
        if (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then return 0; fi
        sleep 0.5
    done
    return 1
}

# port_free HOST PORT: nothing accepts connections there yet.
port_free() { ! (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# start_detached NAME LOGFILE CMD...: run CMD in its own session (process group = its pid, so
# stop.sh can end it and every child it spawns), write $PID_DIR/NAME.pid, print the pid.
start_detached() {
    local name=$1 logfile=$2; shift 2
    local pidfile="$PID_DIR/$name.pid"
    mkdir -p "$PID_DIR" "$(dirname "$logfile")"
    if [[ -f $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        die "$name is already running (pid $(cat "$pidfile")); deploy/stop.sh $name first"
    fi
    setsid "$@" </dev/null >>"$logfile" 2>&1 &
    local pid=$!
    echo "$pid" >"$pidfile"
    echo "$pid"
}
