#!/usr/bin/env bash
# A private two-node Slurm cluster on this one machine, for tests (Debian bookworm's slurm-wlm 22.05; root, no
# systemd needed):
#
#   up.sh DIR        # prints "export SLURM_CONF=DIR/slurm.conf" once both nodes are idle
#   down.sh DIR      # stops it (tests/support/slurm/down.sh)
#
# Two slurmd (`slurmd -N n1`, `-N n2`, distinct ports) beside one slurmctld, every file (config, state, spool,
# logs, pids) under DIR, ports free ones on 127.0.0.1. auth/none: anyone on this machine may act as any user
# towards this cluster, which is acceptable for a root-only test fixture that lives for one test and nothing
# else. No cgroup plugin (proctrack/pgid, task/none). The node names resolve (to 127.0.0.1) only inside the
# daemons' private mount namespace, where /etc/hosts is a bind-mounted copy with n1 and n2 added; job steps
# inherit it, so `--rdzv-endpoint n1:PORT` works in a job while the machine's /etc/hosts stays untouched.
set -euo pipefail
D=$(realpath -m "$1")
mkdir -p "$D"/{state,spool/n1,spool/n2,log}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
CTL_PORT=$(free_port)
P1=$(free_port)
P2=$(free_port)
HOST=$(hostname -s)
CPUS=$(nproc)
cat >"$D/slurm.conf" <<CONF
ClusterName=mrltest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTL_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid.slurm
SlurmdPidFile=$D/slurmd-%n.pid.slurm
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MailProg=/bin/true
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$P1 CPUs=$CPUS RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$P2 CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF=$D/slurm.conf
{ cat /etc/hosts; echo "127.0.0.1 n1 n2"; } >"$D/hosts"
# Every daemon's output goes to a file: one left holding this script's stdout would keep its caller (a test reading
# the output to the end) waiting long after the script exits.
setsid unshare -m --propagation private bash -c "mount --bind '$D/hosts' /etc/hosts && exec sleep infinity" \
    </dev/null >>"$D/log/nsholder.out" 2>&1 &
echo $! >"$D/nsholder.pid"
for _ in $(seq 50); do
    nsenter -t "$(<"$D/nsholder.pid")" -m getent hosts n1 >/dev/null 2>&1 && break
    sleep 0.1
done
NS=(nsenter -t "$(<"$D/nsholder.pid")" -m)
setsid "${NS[@]}" slurmctld -D -i -f "$D/slurm.conf" </dev/null >>"$D/log/slurmctld.out" 2>&1 &
echo $! >"$D/slurmctld.pid"
for n in n1 n2; do
    setsid "${NS[@]}" slurmd -D -N $n -f "$D/slurm.conf" </dev/null >>"$D/log/slurmd-$n.out" 2>&1 &
    echo $! >"$D/slurmd-$n.pid"
done
for _ in $(seq 300); do
    if [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle') == 2 ]]; then
        echo "export SLURM_CONF=$D/slurm.conf"
        exit 0
    fi
    sleep 0.2
done
echo "up.sh: the nodes were not idle within 60 s" >&2
sinfo -N >&2 || true
tail -n 5 "$D"/log/* >&2
exit 1
