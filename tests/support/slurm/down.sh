#!/usr/bin/env bash
# Stop what up.sh DIR started: cancel the jobs and wait for them (at most 20 s), stop the daemons by their recorded
# pids, then kill any slurmstepd of this cluster left behind (slurmstepd runs in a session of its own, outside
# slurmd's process group; it is found by SLURM_CONF=DIR/slurm.conf in its environment, so no other cluster's or
# user's process is touched).
D=$(realpath -m "$1")
export SLURM_CONF=$D/slurm.conf
if [[ -f $D/slurmctld.pid ]] && kill -0 "$(<"$D/slurmctld.pid")" 2>/dev/null; then
    scancel --user=root >/dev/null 2>&1 || true
    for _ in $(seq 100); do
        [[ -z $(squeue -h 2>/dev/null) ]] && break
        sleep 0.2
    done
fi
PIDS=("$D"/slurmd-n1.pid "$D"/slurmd-n2.pid "$D"/slurmctld.pid "$D"/nsholder.pid)
for f in "${PIDS[@]}"; do
    [[ -f $f ]] && kill -TERM "$(<"$f")" 2>/dev/null
done
for f in "${PIDS[@]}"; do
    [[ -f $f ]] || continue
    pid=$(<"$f")
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL -- "-$pid" 2>/dev/null # its session's process group (setsid made it the leader)
    rm -f "$f"
done
for p in /proc/[0-9]*; do
    [[ $(cat "$p/comm" 2>/dev/null) == slurmstepd ]] || continue
    if tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qx "SLURM_CONF=$D/slurm.conf"; then
        pgid=$(awk '{print $5}' "$p/stat")
        kill -KILL -- "-$pgid" 2>/dev/null || kill -KILL "${p#/proc/}" 2>/dev/null
    fi
done
exit 0
