#!/usr/bin/env bash
# One-node launch of a megatron-rl run with trainer and generation in separate processes, the same split a
# multi-node job uses (launch/slurm/train.sbatch), so that a config that runs here runs there:
#
#   launch/torchrun.sh CONFIG [dotted.overrides=...] [--resume]
#
#   1. a private Ray head on loopback (launch/ray_cluster.sh start-head),
#   2. the launcher in the background: `megatron-rl train CONFIG ... --ray-address HEAD --external-trainer`
#      (rollout buffer, vLLM engines, generation driver; writes <output_dir>/<name>/trainer_spec.json),
#   3. once the spec is there, the trainer: `python -m megatron_rl.parallel.torchrun --nnodes 1 --nproc-per-node
#      WORLD --rdzv-endpoint HEAD_ADDR:0 --local-addr HEAD_ADDR -m megatron_rl.trainer.loop SPEC` (torchrun
#      with its stores bound to that address; WORLD = tp * pp * dp of trainer.parallel), output in
#      <run_dir>/trainer.log,
#   4. waits for both; if either fails the other is stopped and the script exits non-zero naming the side; Ray is
#      stopped on every exit (trap), including Ctrl-C.
#
# GPUs: when the node has at least WORLD + the engines' GPUs, the trainer gets the first WORLD devices and Ray
# the rest (MRL_GPU_SPLIT=0 shares all of them instead, as a colocated run with vLLM's gpu_memory_utilization).
#
# Environment (all optional):
#   MRL_PYTHON            Python with megatron-rl (default: .venv/bin/python at the repository root)
#   MRL_DRY_RUN=1         print the commands, one `[dry-run] TAG: COMMAND` line each, and run nothing
#   MRL_RESUME=1          same as --resume: continue from the latest checkpoint in checkpoint.save_dir
#   MRL_BIND_ADDR         address of the Ray head (default 127.0.0.1: nothing listens beyond this machine)
#   MRL_RAY_PORT          Ray head port (default: a free one)
#   MRL_RAY_TIMEOUT_S     Ray start deadline (default 300)
#   MRL_SPEC_TIMEOUT_S    deadline for the launcher to write the spec (model, engines up; default 1800)
#   MRL_FINISH_TIMEOUT_S  once one side has finished cleanly, how long the other may take (default 600)
#   MRL_TIMEOUT_S         deadline of the whole run (default 0: none; each side has its own liveness
#                         timeouts, trainer.timeout_s, so neither waits forever for the other)
#   MRL_GPU_SPLIT         auto (default) or 0, see above
set -euo pipefail

MRL_PROG=torchrun.sh
MRL_REPO=${MRL_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/lib.sh
source "$MRL_REPO/launch/lib.sh"

SPEC_TIMEOUT=${MRL_SPEC_TIMEOUT_S:-1800}
FINISH_TIMEOUT=${MRL_FINISH_TIMEOUT_S:-600}
RUN_TIMEOUT=${MRL_TIMEOUT_S:-0}
GRACE=${MRL_STOP_GRACE_S:-45}

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

# Split the arguments: the config, dotted overrides for the config, and flags for the launcher.
parse_args() {
    CONFIG=""
    OVERRIDES=()
    LAUNCHER_FLAGS=()
    while (($#)); do
        case "$1" in
            -h | --help) usage ;;
            --resume) LAUNCHER_FLAGS+=(--resume); shift ;;
            -*) mrl_die "unknown option '$1' (overrides look like trainer.parallel.tp=2)" 2 ;;
            *)
                if [[ -z "$CONFIG" ]]; then CONFIG=$1; else OVERRIDES+=("$1"); fi
                shift
                ;;
        esac
    done
    [[ -n "$CONFIG" ]] || usage
    if [[ "${MRL_RESUME:-0}" == 1 && ${#LAUNCHER_FLAGS[@]} -eq 0 ]]; then
        LAUNCHER_FLAGS+=(--resume)
    fi
}

# The GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else every GPU nvidia-smi lists.
visible_gpus() {
    GPUS=()
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        IFS=, read -r -a GPUS <<<"$CUDA_VISIBLE_DEVICES"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        local count
        count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
        ((count > 0)) && mapfile -t GPUS < <(seq 0 $((count - 1)))
    fi
    return 0
}

# Give the trainer the first WORLD GPUs and Ray the rest when there are enough for both, so that Ray does not
# place engines on the trainer's devices. Sets TRAINER_ENV and RAY_ENV (env assignments) and RAY_GPU_ARGS.
plan_gpus() {
    TRAINER_ENV=()
    RAY_ENV=()
    RAY_GPU_ARGS=()
    visible_gpus
    local total=${#GPUS[@]}
    ((total > 0)) || return 0
    if [[ "${MRL_GPU_SPLIT:-auto}" != 0 ]] && ((total >= MRL_WORLD_SIZE + MRL_ENGINE_GPUS)); then
        local trainer_ids ray_ids
        trainer_ids=$(IFS=,; echo "${GPUS[*]:0:MRL_WORLD_SIZE}")
        ray_ids=$(IFS=,; echo "${GPUS[*]:MRL_WORLD_SIZE}")
        TRAINER_ENV=("CUDA_VISIBLE_DEVICES=$trainer_ids")
        RAY_ENV=("CUDA_VISIBLE_DEVICES=$ray_ids")
        RAY_GPU_ARGS=(--num-gpus "$((total - MRL_WORLD_SIZE))")
        mrl_log "GPUs: trainer $trainer_ids, Ray (engines) $ray_ids"
    else
        RAY_GPU_ARGS=(--num-gpus "$total")
        mrl_log "GPUs: $total shared by trainer ($MRL_WORLD_SIZE) and engines ($MRL_ENGINE_GPUS)"
    fi
}

# Environment of the trainer ranks: one compute thread each when they would oversubscribe the CPUs (as
# megatron_rl.parallel.torchrun does), unbuffered output, and Megatron's TP/SP overlap setting.
trainer_env() {
    local threads=$(($(nproc) / MRL_WORLD_SIZE))
    ((threads >= 1)) || threads=1
    TRAINER_ENV+=(
        "OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}"
        "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
        PYTHONUNBUFFERED=1
    )
}

# Runs on every exit (success, error, Ctrl-C): stop what is still running, newest first, then Ray.
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "${TRAINER_PID:-}" ]] && mrl_alive "$TRAINER_PID"; then
        mrl_log "stopping the trainer (pid $TRAINER_PID)"
    fi
    mrl_stop_group "${TRAINER_PID:-}" "$GRACE"
    if [[ -n "${LAUNCHER_PID:-}" ]] && mrl_alive "$LAUNCHER_PID"; then
        mrl_log "stopping the launcher (pid $LAUNCHER_PID)"
    fi
    mrl_stop_group "${LAUNCHER_PID:-}" "$GRACE" # its engines die with it (Ray ends a dead driver's actors)
    if [[ "${RAY_STARTED:-0}" == 1 ]]; then
        bash "$MRL_REPO/launch/ray_cluster.sh" stop --state-dir "$STATE_DIR" || true
        if ((rc == 0)) && [[ "${STATE_DIR_OWNED:-0}" == 1 ]]; then
            rm -rf "$STATE_DIR"
        else
            mrl_log "Ray logs kept in $STATE_DIR/ray"
        fi
    fi
    exit "$rc"
}

# Poll both sides until the run is over; returns the script's exit status. Each exit of one side decides what
# happens to the other: a failure stops it at once, a success gives it FINISH_TIMEOUT to finish too.
supervise() {
    local started=$SECONDS deadline=""
    while true; do
        if ! mrl_alive "$TRAINER_PID"; then
            mrl_reap "$TRAINER_PID"
            TRAINER_PID=""
            if ((MRL_RC != 0)); then
                mrl_tail "$MRL_RUN_DIR/trainer.log" 40
                mrl_die "the trainer (torchrun) failed with exit status $MRL_RC; log $MRL_RUN_DIR/trainer.log; stopping the launcher" "$MRL_RC"
            fi
            mrl_log "trainer finished; waiting up to ${FINISH_TIMEOUT} s for the launcher"
            mrl_wait_exit "$LAUNCHER_PID" "$FINISH_TIMEOUT" ||
                mrl_die "the trainer finished but the launcher did not exit within ${FINISH_TIMEOUT} s (MRL_FINISH_TIMEOUT_S)"
            mrl_reap "$LAUNCHER_PID"
            LAUNCHER_PID=""
            ((MRL_RC == 0)) || mrl_die "the launcher failed with exit status $MRL_RC after the trainer finished; log $MRL_RUN_DIR/launcher.log" "$MRL_RC"
            return 0
        fi
        if ! mrl_alive "$LAUNCHER_PID"; then
            mrl_reap "$LAUNCHER_PID"
            LAUNCHER_PID=""
            if ((MRL_RC != 0)); then
                mrl_die "the launcher (megatron-rl train) failed with exit status $MRL_RC; log $MRL_RUN_DIR/launcher.log; stopping the trainer" "$MRL_RC"
            fi
            mrl_log "launcher finished; waiting up to ${FINISH_TIMEOUT} s for the trainer"
            mrl_wait_exit "$TRAINER_PID" "$FINISH_TIMEOUT" ||
                mrl_die "the launcher finished but the trainer did not exit within ${FINISH_TIMEOUT} s (MRL_FINISH_TIMEOUT_S)"
            mrl_reap "$TRAINER_PID"
            TRAINER_PID=""
            ((MRL_RC == 0)) || mrl_die "the trainer failed with exit status $MRL_RC; log $MRL_RUN_DIR/trainer.log" "$MRL_RC"
            return 0
        fi
        if ((RUN_TIMEOUT > 0)); then
            deadline=$((started + RUN_TIMEOUT))
            ((SECONDS < deadline)) || mrl_die "the run passed its deadline of ${RUN_TIMEOUT} s (MRL_TIMEOUT_S)" 124
        fi
        sleep 1
    done
}

main() {
    parse_args "$@"
    mrl_check_python
    mrl_resolve_config "$CONFIG" "${OVERRIDES[@]}"
    mrl_log "run $MRL_RUN_NAME: trainer $MRL_LAYOUT on $MRL_WORLD_SIZE processes, run dir $MRL_RUN_DIR"

    local node_ip=${MRL_BIND_ADDR:-127.0.0.1} port
    if mrl_dry_run; then
        port=${MRL_RAY_PORT:-6379}
        STATE_DIR=${MRL_RAY_STATE_DIR:-/tmp/mrl-ray-dry-run}
    else
        port=${MRL_RAY_PORT:-$(mrl_free_port)}
        if [[ -n "${MRL_RAY_STATE_DIR:-}" ]]; then
            STATE_DIR=$MRL_RAY_STATE_DIR
        else
            STATE_DIR=$(mktemp -d /tmp/mrl-ray-XXXXXX) # short: Ray's socket paths live under it
            STATE_DIR_OWNED=1
        fi
    fi
    local address="$node_ip:$port"
    # Drivers (launcher, trainer rank 0) must use the same Ray settings as the head: token auth, and on
    # loopback the switch that keeps Ray from swapping 127.0.0.1 for the host's address (see ray_cluster.sh).
    [[ "${RAY_AUTH_MODE:-token}" == disabled ]] || export RAY_AUTH_MODE=token
    if mrl_is_loopback "$node_ip"; then
        export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
        mrl_loopback_gloo # Ray's engines, the launcher and the trainer all inherit it
    fi
    plan_gpus
    trainer_env

    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM

    RAY_STARTED=1
    local ray_head=(bash "$MRL_REPO/launch/ray_cluster.sh" start-head --port "$port" --node-ip "$node_ip"
        --state-dir "$STATE_DIR" "${RAY_GPU_ARGS[@]}")
    ((${#RAY_ENV[@]} == 0)) || ray_head=(env "${RAY_ENV[@]}" "${ray_head[@]}")
    mrl_run ray-head "${ray_head[@]}"

    local launcher=("$MRL_PYTHON" -m megatron_rl.cli train "$CONFIG" "${OVERRIDES[@]}" --ray-address "$address"
        --external-trainer "${LAUNCHER_FLAGS[@]}")
    # torchrun whose stores listen on node_ip only (plain torchrun listens on every interface).
    local trainer=(env "${TRAINER_ENV[@]}" "$MRL_PYTHON" -m megatron_rl.parallel.torchrun --nnodes 1
        --nproc-per-node "$MRL_WORLD_SIZE" --rdzv-backend c10d --rdzv-endpoint "$node_ip:0" --local-addr "$node_ip"
        --max-restarts 0 -m megatron_rl.trainer.loop "$MRL_SPEC")
    if mrl_dry_run; then
        mrl_show launcher "${launcher[@]}"
        mrl_show wait-spec "$MRL_SPEC" --timeout "$SPEC_TIMEOUT"
        mrl_show trainer "${trainer[@]}"
        mrl_show ray-stop bash "$MRL_REPO/launch/ray_cluster.sh" stop --state-dir "$STATE_DIR"
        RAY_STARTED=0
        return 0
    fi

    mkdir -p "$MRL_RUN_DIR"
    rm -f "$MRL_SPEC" # a previous run's spec must not start this run's trainer
    mrl_log "launcher: $(mrl_quote "${launcher[@]}") (log $MRL_RUN_DIR/launcher.log)"
    setsid "${launcher[@]}" > >(tee "$MRL_RUN_DIR/launcher.log") 2>&1 </dev/null &
    LAUNCHER_PID=$!
    mrl_wait_for_spec "$MRL_SPEC" "$LAUNCHER_PID" "$SPEC_TIMEOUT"

    mrl_log "trainer: $(mrl_quote "${trainer[@]}") (log $MRL_RUN_DIR/trainer.log)"
    setsid "${trainer[@]}" >"$MRL_RUN_DIR/trainer.log" 2>&1 </dev/null &
    TRAINER_PID=$!
    supervise
    mrl_log "run $MRL_RUN_NAME finished: $MRL_RUN_DIR"
}

main "$@"
