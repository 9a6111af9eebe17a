#!/usr/bin/env bash
# Stop what the deploy scripts started: the process named by each $FEDMASK_DEPLOY_DIR/pids/*.pid
# (or only the names given: superlink, supernode-NAME) with everything it spawned. The deploy
# scripts start each process in its own session; Flower starts some children in sessions of their
# own (the SuperLink's flower-superexec), so the whole tree is collected first -- process group,
# descendants and their sessions -- then sent SIGTERM, and SIGKILL after $FEDMASK_STOP_TIMEOUT s.
#   deploy/stop.sh [NAME ...]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

alive() {  # a process that exists and is not a zombie
    local stat
    stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ -n $stat && $stat != Z* ]]
}

tree_of() {  # the pid, its process group, its descendants and their sessions, to a fixpoint
    local -A seen=()
    local queue=("$1") p q
    while ((${#queue[@]})); do
        p=${queue[0]}; queue=("${queue[@]:1}")
        [[ -n ${seen[$p]:-} ]] && continue
        seen[$p]=1
        for q in $(pgrep -P "$p" 2>/dev/null) $(pgrep -g "$p" 2>/dev/null) $(pgrep -s "$p" 2>/dev/null); do
            [[ -z ${seen[$q]:-} ]] && queue+=("$q")
        done
    done
    echo "${!seen[@]}"
}

if [[ $# -gt 0 ]]; then
    pidfiles=(); for n in "$@"; do pidfiles+=("$PID_DIR/$n.pid"); done
else
    shopt -s nullglob
    pidfiles=()
    for f in "$PID_DIR"/*.pid; do [[ $f == */superlink.pid ]] || pidfiles+=("$f"); done  # SuperNodes first
    [[ -f $PID_DIR/superlink.pid ]] && pidfiles+=("$PID_DIR/superlink.pid")
fi
[[ ${#pidfiles[@]} -gt 0 ]] || { echo "nothing to stop in $PID_DIR"; exit 0; }

all=()
for f in "${pidfiles[@]}"; do
    [[ -f $f ]] || { echo "no pid file $f"; continue; }
    pid=$(cat "$f")
    if [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" && grep -qa flower- "/proc/$pid/cmdline" 2>/dev/null; then
        procs=$(tree_of "$pid")
        echo "stopping $(basename "$f" .pid): pids $procs"
        # shellcheck disable=SC2086
        kill -TERM $procs 2>/dev/null
        all+=($procs)
    fi
    rm -f "$f"
done
((${#all[@]})) || exit 0

deadline=$((SECONDS + FEDMASK_STOP_TIMEOUT))
while ((SECONDS < deadline)); do
    left=(); for p in "${all[@]}"; do alive "$p" && left+=("$p"); done
    ((${#left[@]})) || exit 0
    sleep 0.2
done
left=(); for p in "${all[@]}"; do alive "$p" && left+=("$p"); done
if ((${#left[@]})); then
    echo "still alive after ${FEDMASK_STOP_TIMEOUT}s, SIGKILL: ${left[*]}"
    kill -KILL "${left[@]}" 2>/dev/null
fi
exit 0
