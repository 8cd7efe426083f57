#!/usr/bin/env bash
# Bring up, join, wait for, inspect and stop the Ray cluster of a megatron-rl run (engines and rollout buffer
# live there; the Megatron trainer runs under torchrun beside it).
#
#   ray_cluster.sh start-head   [--port P] [--node-ip IP|auto] [--num-gpus N] [--num-cpus N] [--dashboard]
#                               [--dashboard-host H] [--state-dir D] [--block] [--timeout S] [-- RAY_START_ARGS...]
#   ray_cluster.sh start-worker HEAD_IP:PORT [--node-ip IP|auto] [--num-gpus N] [--num-cpus N] [--state-dir D]
#                               [--block] [--timeout S] [-- RAY_START_ARGS...]
#   ray_cluster.sh wait HEAD_IP:PORT NODES [--timeout S]   # until NODES nodes are alive, or fail
#   ray_cluster.sh status [HEAD_IP:PORT] [--state-dir D]   # `ray status`
#   ray_cluster.sh stop [--state-dir D] [--timeout S]      # stop the node this script started here
#   ray_cluster.sh node-ip                                 # this node's routable IPv4 address
#
# Safe defaults: the head binds to loopback (127.0.0.1) unless --node-ip or MRL_BIND_ADDR says otherwise, the
# dashboard is off (--dashboard turns it on, bound to --dashboard-host, 127.0.0.1 by default), and Ray's token
# authentication is on (a token is made, mode 0600, in RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token if there is none;
# RAY_AUTH_MODE=disabled opts out). A node on a loopback address (127.x: several nodes on one machine, for
# tests) takes free ports and binds gloo to loopback.
#
# Without --block, `start-*` runs `ray start --block` in the background in its own session, records its pid in
# the state dir (default /tmp/mrl-ray-$UID, under Slurm /tmp/mrl-ray-$UID-JOB-NODE, or MRL_RAY_STATE_DIR) and returns once the node is up; `stop` ends
# exactly that process group. It never runs `ray stop`, which would kill every Ray node of the machine,
# including other users' and other runs'. With --block (under `srun`), it stays in the foreground: ending the
# step ends the node.
#
# Environment: MRL_PYTHON, MRL_DRY_RUN=1 (print the commands), MRL_BIND_ADDR (head address), MRL_RAY_PORT
# (default 6379), MRL_RAY_STATE_DIR, MRL_RAY_TIMEOUT_S (default 300), MRL_IFNAME (interface for node-ip/auto).
set -euo pipefail

MRL_PROG=ray_cluster.sh
MRL_REPO=${MRL_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/lib.sh
source "$MRL_REPO/launch/lib.sh"

# One per node and job under Slurm: several nodes of a job may share a machine, and several jobs a node.
if [[ -n "${SLURM_JOB_ID:-}" && -n "${SLURMD_NODENAME:-}" ]]; then
    STATE_DIR=${MRL_RAY_STATE_DIR:-/tmp/mrl-ray-$(id -u)-$SLURM_JOB_ID-$SLURMD_NODENAME}
else
    STATE_DIR=${MRL_RAY_STATE_DIR:-/tmp/mrl-ray-$(id -u)}
fi
TIMEOUT=${MRL_RAY_TIMEOUT_S:-300}

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

# The `ray` command of MRL_PYTHON's environment (the console script beside it, else the module).
ray_cmd() {
    local bin
    bin="$(dirname "$MRL_PYTHON")/ray"
    if [[ -x "$bin" ]]; then
        RAY=("$bin")
    else
        RAY=("$MRL_PYTHON" -m ray.scripts.scripts)
    fi
}

# Token authentication: a cluster without it runs code for anyone who reaches its ports. `ray start` enables it
# only when a token already exists, and drivers (the launcher, trainer rank 0) only when RAY_AUTH_MODE=token,
# so make sure of both. The token is made here (Ray's own `get-auth-token --generate` writes it mode 0644, and
# always to ~/.ray/auth_token, whatever RAY_AUTH_TOKEN_PATH says): 64 hex digits, readable by this user only; an
# existing token file that others may read is made private. On several nodes the token file must be readable
# everywhere (a shared home directory, or RAY_AUTH_TOKEN_PATH on a shared filesystem).
ensure_auth() {
    [[ "${RAY_AUTH_MODE:-token}" == disabled ]] && return 0
    export RAY_AUTH_MODE=token
    [[ -z "${RAY_AUTH_TOKEN:-}" ]] || return 0
    mrl_dry_run && return 0
    local token_file=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
    if [[ ! -s "$token_file" ]]; then
        [[ "$1" == head ]] || return 0 # a worker or driver uses the head's token; Ray says so if it has none
        (
            umask 077
            mkdir -p "$(dirname "$token_file")"
            "$MRL_PYTHON" -c 'import secrets, sys; open(sys.argv[1], "x").write(secrets.token_hex(32))' "$token_file.$$" &&
                mv -f "$token_file.$$" "$token_file"
        ) || mrl_die "could not create the Ray auth token $token_file"
        mrl_log "made a Ray auth token: $token_file (mode 0600)"
    fi
    if [[ -O "$token_file" && -n "$(find "$token_file" -perm /077 2>/dev/null)" ]]; then
        chmod 600 "$token_file" || mrl_die "could not make $token_file private (chmod 600)"
        mrl_log "made the Ray auth token $token_file private (it was readable by others; mode 0600 now)"
    fi
}

# Refuse to start a second node under the same state dir: its pid file would be overwritten and the first node
# could then never be stopped by `stop`.
check_not_running() {
    local pid
    if [[ -f "$STATE_DIR/ray.pid" ]]; then
        pid=$(<"$STATE_DIR/ray.pid")
        if mrl_alive "$pid"; then
            mrl_die "a Ray node started by this script is running under $STATE_DIR (pid $pid); run '$MRL_PROG stop --state-dir $STATE_DIR' first"
        fi
    fi
}

# Run `ray start --block` in the foreground (--block) or in the background, returning once it is up.
launch_node() {
    local role=$1 block=$2
    shift 2
    local cmd=("${RAY[@]}" start --block "$@")
    if [[ "$block" == 1 ]]; then
        if mrl_dry_run; then
            mrl_show "ray-$role" "${cmd[@]}"
            return
        fi
        exec "${cmd[@]}"
    fi
    check_not_running
    if mrl_dry_run; then
        mrl_show "ray-$role" "${cmd[@]}"
        return
    fi
    mkdir -p "$STATE_DIR"
    chmod 700 "$STATE_DIR"
    local log="$STATE_DIR/ray.log" pid deadline
    # Its own session: `stop` (and the launcher's clean-up) can end the node's whole process group, and only it.
    setsid "${cmd[@]}" >"$log" 2>&1 </dev/null &
    pid=$!
    printf '%s\n' "$pid" >"$STATE_DIR/ray.pid"
    deadline=$((SECONDS + TIMEOUT))
    until grep -q "Ray runtime started" "$log" 2>/dev/null; do
        if ! mrl_alive "$pid"; then
            mrl_tail "$log"
            rm -f "$STATE_DIR/ray.pid"
            mrl_die "ray start ($role) exited before the node came up; log $log"
        fi
        if ((SECONDS >= deadline)); then
            mrl_tail "$log"
            mrl_stop_group "$pid" 10
            rm -f "$STATE_DIR/ray.pid"
            mrl_die "the Ray $role did not come up within ${TIMEOUT} s (MRL_RAY_TIMEOUT_S); log $log"
        fi
        sleep 0.5
    done
    mrl_log "Ray $role up (pid $pid, state $STATE_DIR)"
}

# Options shared by start-head and start-worker; sets the variables below and EXTRA (args after --).
parse_start_args() {
    PORT=${MRL_RAY_PORT:-6379}
    NODE_IP=""
    NUM_GPUS=""
    NUM_CPUS=""
    DASHBOARD=0
    DASHBOARD_HOST=127.0.0.1
    BLOCK=0
    EXTRA=()
    while (($#)); do
        case "$1" in
            --port) PORT=$2; shift 2 ;;
            --node-ip) NODE_IP=$2; shift 2 ;;
            --num-gpus) NUM_GPUS=$2; shift 2 ;;
            --num-cpus) NUM_CPUS=$2; shift 2 ;;
            --dashboard) DASHBOARD=1; shift ;;
            --dashboard-host) DASHBOARD_HOST=$2; shift 2 ;;
            --state-dir) STATE_DIR=$2; shift 2 ;;
            --block) BLOCK=1; shift ;;
            --timeout) TIMEOUT=$2; shift 2 ;;
            --) shift; EXTRA=("$@"); break ;;
            *) mrl_die "unknown option '$1' (see '$MRL_PROG --help')" 2 ;;
        esac
    done
    if [[ "$NODE_IP" == auto ]]; then
        NODE_IP=$(mrl_node_ip)
    fi
}

# Whether the caller already passed a ray start option (in the args after --).
has_extra() {
    local arg
    for arg in "${EXTRA[@]}"; do
        [[ "$arg" == "$1" || "$arg" == "$1="* ]] && return 0
    done
    return 1
}

cmd_start_head() {
    parse_start_args "$@"
    NODE_IP=${NODE_IP:-${MRL_BIND_ADDR:-127.0.0.1}}
    local args=(--head "--port=$PORT" "--node-ip-address=$NODE_IP" "--temp-dir=$STATE_DIR/ray")
    if [[ "$DASHBOARD" == 1 ]]; then
        args+=(--include-dashboard=true "--dashboard-host=$DASHBOARD_HOST")
    else
        args+=(--include-dashboard=false)
    fi
    [[ -n "$NUM_GPUS" ]] && args+=("--num-gpus=$NUM_GPUS")
    [[ -n "$NUM_CPUS" ]] && args+=("--num-cpus=$NUM_CPUS")
    if mrl_is_loopback "$NODE_IP"; then
        # Ray's CLI replaces a loopback node address by the host's routable one (and then serves on it) unless
        # this (misnamed) switch is off; drivers that join must see it too, which the launchers arrange.
        export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
        mrl_loopback_gloo # the engines' weight-sync groups and vLLM's own
        # Fixed default ports (client server 10001, dashboard agent 52365) collide with other Ray instances on a
        # shared machine; a private single-node head takes free ones.
        has_extra --ray-client-server-port || args+=("--ray-client-server-port=$(mrl_free_port)")
        has_extra --dashboard-agent-listen-port || args+=("--dashboard-agent-listen-port=$(mrl_free_port)")
        # Ray starts a dashboard process on 8265 even with --include-dashboard=false.
        [[ "$DASHBOARD" == 1 ]] || has_extra --dashboard-port || args+=("--dashboard-port=$(mrl_free_port)")
    fi
    ensure_auth head
    launch_node head "$BLOCK" "${args[@]}" "${EXTRA[@]}"
    mrl_dry_run || printf '%s:%s\n' "$NODE_IP" "$PORT" >"$STATE_DIR/address"
}

cmd_start_worker() {
    (($#)) || mrl_die "start-worker needs the head's HEAD_IP:PORT" 2
    local head=$1
    shift
    [[ "$head" == *:* ]] || mrl_die "start-worker: '$head' is not HEAD_IP:PORT" 2
    parse_start_args "$@"
    # No loopback default here: a worker registers under the address from which it reaches the head (Ray's own
    # choice), which is also the one a driver on this node computes, so both agree.
    NODE_IP=${NODE_IP:-${MRL_BIND_ADDR:-}}
    local args=("--address=$head")
    [[ -n "$NODE_IP" ]] && args+=("--node-ip-address=$NODE_IP")
    if [[ -n "$NODE_IP" ]] && mrl_is_loopback "$NODE_IP"; then
        # Another node of the same machine (a test cluster) holds the fixed default port already.
        has_extra --dashboard-agent-listen-port || args+=("--dashboard-agent-listen-port=$(mrl_free_port)")
        mrl_loopback_gloo
    fi
    [[ -n "$NUM_GPUS" ]] && args+=("--num-gpus=$NUM_GPUS")
    [[ -n "$NUM_CPUS" ]] && args+=("--num-cpus=$NUM_CPUS")
    ensure_auth worker
    launch_node worker "$BLOCK" "${args[@]}" "${EXTRA[@]}"
}

# Wait until the cluster at $1 has at least $2 alive nodes. A driver connects from here, so this must run on a
# node of the cluster (the head); `timeout` bounds it even if Ray's own connection retries hang.
cmd_wait() {
    (($# >= 2)) || mrl_die "wait needs HEAD_IP:PORT and the number of nodes" 2
    local addr=$1 nodes=$2
    shift 2
    while (($#)); do
        case "$1" in
            --timeout) TIMEOUT=$2; shift 2 ;;
            *) mrl_die "unknown option '$1'" 2 ;;
        esac
    done
    if mrl_dry_run; then
        mrl_show ray-wait "$addr" "$nodes" --timeout "$TIMEOUT"
        return
    fi
    mrl_is_loopback "${addr%:*}" && export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    ensure_auth driver
    local rc=0
    timeout -k 10 "$((TIMEOUT + 30))" "$MRL_PYTHON" - "$addr" "$nodes" "$TIMEOUT" <<'PY' || rc=$?
import sys, time

addr, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
import ray

error = None
while not ray.is_initialized():
    try:
        ray.init(address=addr, namespace="megatron-rl", logging_level="ERROR", log_to_driver=False,
                 configure_logging=False)
    except Exception as err:  # the head may not be up yet
        error = err
        if time.monotonic() > deadline:
            sys.exit(f"ray_cluster.sh: error: cannot connect to the Ray cluster at {addr} within {timeout:.0f} s: {error!r}")
        time.sleep(2)
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        gpus = sum(n["Resources"].get("GPU", 0) for n in alive)
        cpus = sum(n["Resources"].get("CPU", 0) for n in alive)
        print(f"ray_cluster.sh: {len(alive)} nodes alive at {addr} ({cpus:.0f} CPUs, {gpus:.0f} GPUs): "
              + " ".join(sorted(n["NodeManagerAddress"] for n in alive)), file=sys.stderr)
        sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit(f"ray_cluster.sh: error: only {len(alive)} of {want} Ray nodes joined {addr} within {timeout:.0f} s "
                 f"(alive: {sorted(n['NodeManagerAddress'] for n in alive)}); see the worker steps' output")
    time.sleep(2)
PY
    ((rc == 0)) || {
        ((rc == 124 || rc == 137)) && mrl_die "waiting for $nodes Ray nodes at $addr ran past its deadline"
        exit "$rc"
    }
}

cmd_status() {
    local addr=""
    while (($#)); do
        case "$1" in
            --state-dir) STATE_DIR=$2; shift 2 ;;
            -*) mrl_die "unknown option '$1'" 2 ;;
            *) addr=$1; shift ;;
        esac
    done
    if [[ -z "$addr" && -f "$STATE_DIR/address" ]]; then
        addr=$(<"$STATE_DIR/address")
    fi
    [[ -n "$addr" ]] || mrl_die "status: give HEAD_IP:PORT (no head recorded under $STATE_DIR)" 2
    mrl_is_loopback "${addr%:*}" && export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    ensure_auth driver
    mrl_run ray-status timeout 60 "${RAY[@]}" status "--address=$addr"
}

cmd_stop() {
    local grace=30
    while (($#)); do
        case "$1" in
            --state-dir) STATE_DIR=$2; shift 2 ;;
            --timeout) grace=$2; shift 2 ;;
            *) mrl_die "unknown option '$1'" 2 ;;
        esac
    done
    if mrl_dry_run; then
        mrl_show ray-stop stop --state-dir "$STATE_DIR"
        return
    fi
    if [[ ! -f "$STATE_DIR/ray.pid" ]]; then
        mrl_log "no Ray node started by this script under $STATE_DIR; nothing to stop"
        return 0
    fi
    local pid
    pid=$(<"$STATE_DIR/ray.pid")
    # SIGTERM lets `ray start --block` end its node's processes (raylet, GCS, workers); the group kill after
    # the grace period catches anything left.
    mrl_stop_group "$pid" "$grace"
    rm -f "$STATE_DIR/ray.pid" "$STATE_DIR/address"
    mrl_log "Ray node $pid stopped (state $STATE_DIR)"
}

main() {
    (($#)) || usage
    local command=$1
    shift
    case "$command" in
        -h | --help | help) usage ;;
        node-ip) mrl_node_ip; return ;;
    esac
    mrl_check_python
    ray_cmd
    case "$command" in
        start-head) cmd_start_head "$@" ;;
        start-worker) cmd_start_worker "$@" ;;
        wait) cmd_wait "$@" ;;
        status) cmd_status "$@" ;;
        stop) cmd_stop "$@" ;;
        *) mrl_die "unknown command '$command' (start-head, start-worker, wait, status, stop, node-ip)" 2 ;;
    esac
}

main "$@"
