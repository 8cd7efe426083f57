# shellcheck shell=bash
# Helpers shared by the launch scripts (sourced, never run). The caller sets MRL_PROG (its name, for messages)
# and MRL_REPO (the repository root) before sourcing this file.
#
# Conventions every launch script follows:
#   - MRL_PYTHON: the Python with megatron-rl installed (default: .venv/bin/python at the repository root).
#   - MRL_DRY_RUN=1: print every command as one line, `[dry-run] TAG: COMMAND`, instead of running it; COMMAND is
#     quoted like bash's printf %q, so `shlex.split` reads it back. Tests parse these lines.
#   - every wait has a deadline; errors are one line, `PROG: error: ...`, on stderr.

MRL_PYTHON=${MRL_PYTHON:-$MRL_REPO/.venv/bin/python}

# One line on stderr, prefixed with the script's name (stdout is kept for dry-run commands and results).
mrl_log() {
    printf '%s: %s\n' "$MRL_PROG" "$*" >&2
}

# Fail with a one-line message; the optional second argument is the exit status (default 1).
mrl_die() {
    printf '%s: error: %s\n' "$MRL_PROG" "$1" >&2
    exit "${2:-1}"
}

mrl_dry_run() {
    [[ "${MRL_DRY_RUN:-0}" == 1 ]]
}

# The words of a command, quoted so that the line reads back as the same words (bash, or Python's shlex).
mrl_quote() {
    local out="" word
    for word in "$@"; do
        if [[ -n "$word" && "$word" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
            out+="$word " # plain words stay readable (printf %q would escape the commas of a host list)
        else
            out+="$(printf '%q' "$word") "
        fi
    done
    printf '%s' "${out% }"
}

# Print one dry-run line: `[dry-run] TAG: COMMAND`.
mrl_show() {
    local tag=$1
    shift
    printf '[dry-run] %s: %s\n' "$tag" "$(mrl_quote "$@")"
}

# Run a command in the foreground, or only print it under MRL_DRY_RUN=1.
mrl_run() {
    local tag=$1
    shift
    if mrl_dry_run; then
        mrl_show "$tag" "$@"
    else
        "$@"
    fi
}

# Check that MRL_PYTHON can run megatron-rl, so that a missing venv is one clear line, not a traceback later.
mrl_check_python() {
    [[ -x "$MRL_PYTHON" ]] || mrl_die "no Python at $MRL_PYTHON: run 'bash scripts/setup.sh' or set MRL_PYTHON"
}

# Resolve a config (and overrides) into MRL_* shell variables through launch/run_info.py (no torch import).
# `eval` only runs after the helper succeeded: a failed command substitution inside `eval` would go unnoticed.
mrl_resolve_config() {
    local info
    info=$("$MRL_PYTHON" "$MRL_REPO/launch/run_info.py" "$@") || mrl_die "cannot resolve the run config ($*)" 2
    eval "$info"
}

# A TCP port that is free on loopback right now (for a private Ray head; another run may take it later, which
# Ray then reports as a failed start).
mrl_free_port() {
    "$MRL_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

mrl_is_loopback() {
    [[ "$1" == 127.* || "$1" == localhost || "$1" == ::1 ]]
}

# The loopback interface's name (IFF_LOOPBACK, 0x8, in /sys/class/net/*/flags), `lo` if none is found.
mrl_loopback_ifname() {
    local flags
    for flags in /sys/class/net/*/flags; do
        [[ -r "$flags" ]] || continue
        if (($(<"$flags") & 0x8)); then
            basename "$(dirname "$flags")"
            return
        fi
    done
    echo lo
}

# On one machine, gloo (torch's CPU groups, Megatron's, the weight sync's) binds loopback: unset, it binds the
# address the host name resolves to, which may be a LAN address. A GLOO_SOCKET_IFNAME already set is kept.
mrl_loopback_gloo() {
    [[ -n "${GLOO_SOCKET_IFNAME:-}" ]] || export GLOO_SOCKET_IFNAME=$(mrl_loopback_ifname)
}

# This node's routable IPv4 address: the one of MRL_IFNAME when set (the interface the cluster network uses),
# else the first non-loopback address of the host name, else of any interface. Ray registers each node, and
# the weight-sync senders advertise their stores, under the address the others reach them by, and
# `hostname --ip-address` is 127.0.x.1 on some distributions.
mrl_node_ip() {
    local addr
    if [[ -n "${MRL_IFNAME:-}" ]]; then
        addr=$(ip -4 -o addr show dev "$MRL_IFNAME" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
        [[ -n "$addr" ]] || mrl_die "MRL_IFNAME=$MRL_IFNAME: no IPv4 address on that interface"
        printf '%s\n' "$addr"
        return
    fi
    # Word splitting is wanted: both commands print a space-separated list.
    # shellcheck disable=SC2046
    for addr in $(hostname --ip-address 2>/dev/null) $(hostname -I 2>/dev/null); do
        [[ "$addr" == *:* ]] && continue # IPv6
        mrl_is_loopback "$addr" && continue
        printf '%s\n' "$addr"
        return
    done
    mrl_die "cannot find a non-loopback IPv4 address of $(hostname); set MRL_IFNAME"
}

mrl_alive() {
    kill -0 "$1" 2>/dev/null
}

# Wait up to $2 seconds for process $1 to exit; succeed if it did.
mrl_wait_exit() {
    local pid=$1 deadline=$((SECONDS + $2))
    while mrl_alive "$pid"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

# Stop a background job started with `setsid` (so its process group id is its pid). First signal $3 (default
# TERM) to the leader alone, which lets it end its own children in order: torchrun's agent stops its ranks,
# `ray start --block` its raylet and GCS (a TERM to the whole group at once would make Ray's drain wait for a
# GCS already gone). After $2 seconds (default 45: torchrun gives its ranks 30 s) SIGKILL whatever is left:
# the group, and the groups of the leader's children, since torchrun starts every rank in a session of its
# own. Only this job's processes are touched.
mrl_stop_group() {
    local pid=$1 grace=${2:-45} sig=${3:-TERM} children child
    [[ -n "$pid" ]] || return 0
    children=$(ps -o pid= --ppid "$pid" 2>/dev/null || true)
    if mrl_alive "$pid"; then
        kill "-$sig" "$pid" 2>/dev/null || true
        mrl_wait_exit "$pid" "$grace" || true
    fi
    kill -KILL -- "-$pid" 2>/dev/null || true
    kill -KILL "$pid" 2>/dev/null || true
    for child in $children; do
        kill -KILL -- "-$child" 2>/dev/null || true # a group of its own (torchrun ranks), if it has one
    done
}

# Stop a background process that is not a group leader (an `srun` step: srun forwards the signal to its
# tasks on every node): SIGTERM, then SIGKILL after $2 seconds.
mrl_stop_pid() {
    local pid=$1 grace=${2:-20}
    [[ -n "$pid" ]] || return 0
    if mrl_alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        mrl_wait_exit "$pid" "$grace" || kill -KILL "$pid" 2>/dev/null || true
    fi
}

# Collect the exit status of a background child that has ended into MRL_RC (bash keeps it until `wait`
# collects it). Never call this in a command substitution: a subshell cannot wait for its parent's children.
mrl_reap() {
    MRL_RC=0
    wait "$1" || MRL_RC=$?
}

# Wait until the launcher (pid $2) has written the trainer spec $1 as complete JSON, for at most $3 seconds.
# Fails at once, with the launcher's status, if the launcher exits first.
mrl_wait_for_spec() {
    local spec=$1 launcher=$2 timeout=$3 deadline
    deadline=$((SECONDS + timeout))
    while true; do
        if [[ -s "$spec" ]] && "$MRL_PYTHON" -c 'import json, sys; json.load(open(sys.argv[1]))' "$spec" 2>/dev/null; then
            return 0
        fi
        if ! mrl_alive "$launcher"; then
            mrl_reap "$launcher"
            mrl_die "the launcher exited (status $MRL_RC) before writing $spec"
        fi
        ((SECONDS < deadline)) || mrl_die "the launcher did not write $spec within ${timeout} s (MRL_SPEC_TIMEOUT_S)"
        sleep 1
    done
}

# The last lines of a log file, indented, for an error report.
mrl_tail() {
    [[ -f "$1" ]] && tail -n "${2:-30}" "$1" | sed 's/^/    /' >&2
    return 0
}
