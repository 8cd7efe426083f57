"""The launch scripts in dry-run mode: the commands a SLURM job and a one-node launch would run.

Each script prints one `[dry-run] TAG: COMMAND` line per command under MRL_DRY_RUN=1 (COMMAND reads back with
shlex); these tests check hosts, node counts, ports and flags of every step without Slurm, Ray or GPUs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
TORCHRUN = REPO / "launch" / "torchrun.sh"
RAY_CLUSTER = REPO / "launch" / "ray_cluster.sh"
LINE = re.compile(r"^\[dry-run\] ([\w-]+): (.*)$")

# Two nodes of 2 GPUs: the quickstart layout (EP2 on 2 processes) on 1 trainer node, 1 inference node.
TWO_NODES = ["cluster.trainer_nodes=1", "cluster.inference_nodes=1", "cluster.gpus_per_node=2"]
# 32 nodes of 8 GPUs: 16 trainer nodes = 128 ranks (TP8 x DP16, EP8), 16 inference nodes.
LAYOUT_128 = ["trainer.parallel.tp=8", "trainer.parallel.ep=8", "trainer.parallel.dp=16"]
THIRTY_TWO_NODES = ["cluster.trainer_nodes=16", "cluster.inference_nodes=16", "cluster.gpus_per_node=8", *LAYOUT_128]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any Slurm, launch or cluster setting that could leak in."""
    drop = (
        "SLURM_",
        "MRL_",
        "TRAINER_NODES",
        "INFERENCE_NODES",
        "GPUS_PER_NODE",
        "RAY_",
        "CUDA_VISIBLE_DEVICES",
        "GLOO_",
        "NCCL_",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(MRL_PYTHON=sys.executable, MRL_DRY_RUN="1")
    env.update(extra)
    return env


def run_script(script: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )  # fmt: skip


def commands(stdout: str) -> list[tuple[str, list[str]]]:
    """(tag, argv) of every dry-run line, in order; any other stdout line is a failure."""
    out = []
    for line in stdout.splitlines():
        match = LINE.match(line)
        assert match, f"unparseable dry-run line: {line!r}"
        argv = shlex.split(match.group(2))
        out.append((match.group(1), argv))
    return out


def by_tag(cmds, tag: str) -> list[list[str]]:
    return [argv for t, argv in cmds if t == tag]


def one(cmds, tag: str) -> list[str]:
    found = by_tag(cmds, tag)
    assert len(found) == 1, (tag, found)
    return found[0]


def option(argv: list[str], name: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` (the first one)."""
    for i, word in enumerate(argv):
        if word == name:
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def split_srun(argv: list[str]) -> tuple[list[str], list[str]]:
    """(srun options, the command srun runs): srun's options are the leading --words and `-w HOST`."""
    assert argv[0] == "srun", argv
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] == "-w" else 1
    return argv[1:i], argv[i:]


def torchrun_args(command: list[str]) -> list[str]:
    """The arguments of torchrun inside a command line: the project's agent (`megatron_rl.parallel.torchrun`,
    torchrun with its stores bound to their host), never plain `torch.distributed.run`."""
    assert "torch.distributed.run" not in command and "torchrun" not in command, command
    i = command.index("megatron_rl.parallel.torchrun")
    assert command[i - 1] == "-m"
    return command[i + 1 :]


def sbatch(args: list[str], hosts: list[str], **env: str) -> subprocess.CompletedProcess:
    env.setdefault("SLURM_JOB_ID", "4242")
    env.setdefault("SLURM_NNODES", str(len(hosts)))
    env.setdefault("SLURM_JOB_NODELIST", "unused[1-99]")  # MRL_HOSTNAMES replaces scontrol
    return run_script(SBATCH, args, clean_env(MRL_HOSTNAMES=" ".join(hosts), **env))


# ---------------------------------------------------------------------------------------------------------------
# SLURM: train.sbatch


def check_job(cmds, trainer_hosts: list[str], inference_hosts: list[str], gpus: int, config: str) -> None:
    """Every step of a job lands on the right hosts with the right sizes."""
    head = inference_hosts[0]
    address = f"{head}:6379"
    all_hosts = trainer_hosts + inference_hosts

    # Ray head on the first inference node, with that node's GPUs.
    opts, cmd = split_srun(one(cmds, "ray-head"))
    assert option(opts, "-w") == head and "--nodes=1" in opts and "--ntasks=1" in opts
    assert cmd[:2] == ["bash", str(RAY_CLUSTER)] and cmd[2] == "start-head" and "--block" in cmd
    assert option(cmd, "--port") == "6379" and option(cmd, "--num-gpus") == str(gpus)
    assert option(cmd, "--node-ip") == head  # a dry run cannot ask the head for its address: its name

    # One worker per other inference node (with GPUs) and per trainer node (none: a local node for rank 0).
    workers = {}
    for argv in by_tag(cmds, "ray-worker"):
        opts, cmd = split_srun(argv)
        host = option(opts, "-w")
        assert host not in workers, f"two Ray workers on {host}"
        assert cmd[2] == "start-worker" and cmd[3] == address and "--block" in cmd
        workers[host] = cmd
    assert sorted(workers) == sorted(inference_hosts[1:] + trainer_hosts)
    assert head not in workers
    for host in inference_hosts[1:]:
        assert option(workers[host], "--num-gpus") == str(gpus)
    for host in trainer_hosts:
        assert option(workers[host], "--num-gpus") == "0" and option(workers[host], "--num-cpus") == "0"

    # The cluster is waited for: the head alone, then every node of the job.
    waits = [split_srun(argv) for argv in by_tag(cmds, "ray-wait")]
    assert [option(o, "-w") for o, _ in waits] == [head, head]
    assert [c[2:5] for _, c in waits] == [["wait", address, "1"], ["wait", address, str(len(all_hosts))]]

    # The launcher runs on the head and joins its cluster, leaving the trainer to the job.
    opts, cmd = split_srun(one(cmds, "launcher"))
    assert option(opts, "-w") == head
    assert cmd[1:5] == ["-m", "megatron_rl.cli", "train", config]
    assert option(cmd, "--ray-address") == address and "--external-trainer" in cmd

    # The trainer: one torchrun agent on each trainer node, exactly those, rendezvous on the first.
    opts, cmd = split_srun(one(cmds, "trainer"))
    assert option(opts, "-w").split(",") == trainer_hosts
    assert option(opts, "--nodes") == option(opts, "--ntasks") == str(len(trainer_hosts))
    assert option(opts, "--ntasks-per-node") == "1"
    assert "--kill-on-bad-exit=1" in opts
    targs = torchrun_args(cmd)
    assert option(targs, "--nnodes") == str(len(trainer_hosts))
    assert option(targs, "--nproc-per-node") == str(gpus)
    assert option(targs, "--rdzv-backend") == "c10d"
    assert option(targs, "--rdzv-endpoint") == f"{trainer_hosts[0]}:29500"
    assert option(targs, "--rdzv-id") == "4242"
    assert targs[-3:-1] == ["-m", "megatron_rl.trainer.loop"] and targs[-1].endswith("trainer_spec.json")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in cmd and "launch/node_env.sh" in " ".join(cmd)

    # Order: Ray before the launcher, the spec before the trainer.
    tags = [t for t, _ in cmds]
    assert tags.index("ray-head") < tags.index("launcher") < tags.index("wait-spec") < tags.index("trainer")


def test_two_node_job():
    hosts = ["gpu-a", "gpu-b"]
    result = sbatch(["configs/quickstart.yaml", *TWO_NODES], hosts)
    assert result.returncode == 0, result.stderr
    cmds = commands(result.stdout)
    check_job(cmds, ["gpu-a"], ["gpu-b"], gpus=2, config="configs/quickstart.yaml")
    launcher = split_srun(one(cmds, "launcher"))[1]
    assert [*TWO_NODES] == [w for w in launcher if w.startswith("cluster.")]
    # The quickstart's weight stores bind to loopback: engines on other nodes could not reach them.
    assert "sync.bind_host=auto" in launcher
    assert one(cmds, "wait-spec")[0] == "runs/quickstart/trainer_spec.json"


def test_thirty_two_node_job():
    hosts = [f"node{i:02d}" for i in range(1, 33)]
    result = sbatch(["configs/quickstart.yaml", *THIRTY_TWO_NODES], hosts)
    assert result.returncode == 0, result.stderr
    check_job(commands(result.stdout), hosts[:16], hosts[16:], gpus=8, config="configs/quickstart.yaml")


def test_node_counts_from_the_environment_when_the_config_has_none():
    hosts = [f"node{i:02d}" for i in range(1, 33)]
    result = sbatch(
        ["configs/quickstart.yaml", *LAYOUT_128], hosts, TRAINER_NODES="16", INFERENCE_NODES="16", GPUS_PER_NODE="8"
    )
    assert result.returncode == 0, result.stderr
    check_job(commands(result.stdout), hosts[:16], hosts[16:], gpus=8, config="configs/quickstart.yaml")


def test_ports_and_resume_flag():
    result = sbatch(
        ["configs/quickstart.yaml", *TWO_NODES, "--resume"], ["a", "b"], MRL_RAY_PORT="7001", MRL_RDZV_PORT="29777"
    )
    assert result.returncode == 0, result.stderr
    cmds = commands(result.stdout)
    launcher = split_srun(one(cmds, "launcher"))[1]
    assert option(launcher, "--ray-address") == "b:7001" and "--resume" in launcher
    assert option(torchrun_args(one(cmds, "trainer")), "--rdzv-endpoint") == "a:29777"


@pytest.mark.parametrize("overrides, resumes", [(["checkpoint.save_dir=/shared/ckpt"], True), ([], False)])
def test_a_requeued_job_resumes_when_it_has_checkpoints(overrides, resumes):
    result = sbatch(["configs/quickstart.yaml", *TWO_NODES, *overrides], ["a", "b"], SLURM_RESTART_COUNT="1")
    assert result.returncode == 0, result.stderr
    assert ("--resume" in split_srun(one(commands(result.stdout), "launcher"))[1]) == resumes


def test_mismatched_node_count_fails_clearly():
    result = sbatch(["configs/quickstart.yaml", *TWO_NODES], ["a", "b", "c"])
    assert result.returncode == 2
    assert "the job has 3 nodes (a b c)" in result.stderr
    assert "cluster.trainer_nodes=1 + cluster.inference_nodes=1 = 2" in result.stderr
    assert "sbatch --nodes=2" in result.stderr
    assert "trainer" not in [t for t, _ in commands(result.stdout)]  # nothing was started


def test_slurm_nnodes_must_match_the_node_list():
    result = sbatch(["configs/quickstart.yaml", *TWO_NODES], ["a", "b"], SLURM_NNODES="5")
    assert result.returncode == 2
    assert "SLURM_NNODES=5" in result.stderr


def test_trainer_nodes_must_match_the_layout():
    # 2 trainer nodes x 2 GPUs = 4 processes, but the quickstart layout is tp1 x dp2 = 2.
    overrides = ["cluster.trainer_nodes=2", "cluster.inference_nodes=1", "cluster.gpus_per_node=2"]
    result = sbatch(["configs/quickstart.yaml", *overrides], ["a", "b", "c"])
    assert result.returncode == 2
    assert "4 trainer processes" in result.stderr and "tp1-pp1-ep2-etp1-dp2" in result.stderr


def test_an_environment_variable_never_silently_overrides_the_config():
    result = sbatch(["configs/quickstart.yaml", *TWO_NODES], ["a", "b"], TRAINER_NODES="2")
    assert result.returncode == 2
    assert "TRAINER_NODES=2 disagrees with cluster.trainer_nodes=1" in result.stderr


def test_missing_node_counts_are_named():
    result = sbatch(["configs/quickstart.yaml"], ["a", "b"])
    assert result.returncode == 2
    assert "cluster.trainer_nodes is not set" in result.stderr and "TRAINER_NODES" in result.stderr


def test_network_environment_follows_the_interface():
    result = sbatch(["configs/quickstart.yaml", *TWO_NODES], ["a", "b"], MRL_IFNAME="ib0", NCCL_IB_HCA="mlx5_0")
    assert result.returncode == 0, result.stderr
    env = {argv[0] for argv in by_tag(commands(result.stdout), "env")}
    assert {"NCCL_SOCKET_IFNAME=ib0", "GLOO_SOCKET_IFNAME=ib0", "NCCL_IB_HCA=mlx5_0", "NCCL_DEBUG=WARN"} <= env
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in env


# ---------------------------------------------------------------------------------------------------------------
# One node: torchrun.sh


def torchrun_dry(args: list[str], **env: str) -> subprocess.CompletedProcess:
    env.setdefault("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever the machine has
    return run_script(TORCHRUN, args, clean_env(**env))


def test_torchrun_sh_one_node():
    result = torchrun_dry(["configs/quickstart.yaml", "steps=2", "--resume"], MRL_RAY_PORT="6500")
    assert result.returncode == 0, result.stderr
    cmds = commands(result.stdout)
    assert [t for t, _ in cmds] == ["ray-head", "launcher", "wait-spec", "trainer", "ray-stop"]
    head = one(cmds, "ray-head")
    assert head[:3] == ["bash", str(RAY_CLUSTER), "start-head"]
    assert option(head, "--node-ip") == "127.0.0.1" and option(head, "--port") == "6500"  # loopback by default
    launcher = one(cmds, "launcher")
    assert launcher[1:6] == ["-m", "megatron_rl.cli", "train", "configs/quickstart.yaml", "steps=2"]
    assert option(launcher, "--ray-address") == "127.0.0.1:6500"
    assert "--external-trainer" in launcher and "--resume" in launcher
    trainer = one(cmds, "trainer")
    targs = torchrun_args(trainer)
    assert option(targs, "--nnodes") == "1" and option(targs, "--nproc-per-node") == "2"  # EP2 on 2 processes
    # Its stores on loopback: the rendezvous endpoint (a free port) and the agent's own address.
    assert option(targs, "--rdzv-endpoint") == "127.0.0.1:0" and option(targs, "--local-addr") == "127.0.0.1"
    assert targs[-3:] == ["-m", "megatron_rl.trainer.loop", "runs/quickstart/trainer_spec.json"]
    assert not [w for w in trainer if w.startswith("CUDA_VISIBLE_DEVICES=")]
    assert one(cmds, "ray-stop")[2] == "stop"


def test_torchrun_sh_splits_the_gpus_between_trainer_and_engines():
    result = torchrun_dry(["configs/quickstart.yaml"], CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert result.returncode == 0, result.stderr
    cmds = commands(result.stdout)
    assert "CUDA_VISIBLE_DEVICES=0,1" in one(cmds, "trainer")
    head = one(cmds, "ray-head")
    assert head[:2] == ["env", "CUDA_VISIBLE_DEVICES=2,3"] and option(head, "--num-gpus") == "2"
    # Sharing instead (colocated): Ray gets every GPU, the trainer sees them all.
    shared = commands(torchrun_dry(["configs/quickstart.yaml"], CUDA_VISIBLE_DEVICES="0,1", MRL_GPU_SPLIT="0").stdout)
    assert option(one(shared, "ray-head"), "--num-gpus") == "2"
    assert not [w for w in one(shared, "trainer") if w.startswith("CUDA_VISIBLE_DEVICES=")]


def test_torchrun_sh_rejects_bad_input():
    result = torchrun_dry(["configs/quickstart.yaml", "trainer.parallel.tp=x"])
    assert result.returncode == 2 and "trainer.parallel.tp" in result.stderr
    result = torchrun_dry(["configs/quickstart.yaml", "--bogus"])
    assert result.returncode == 2 and "unknown option '--bogus'" in result.stderr
    assert torchrun_dry([]).returncode == 2  # usage


# ---------------------------------------------------------------------------------------------------------------
# ray_cluster.sh


def ray_dry(args: list[str], **env: str) -> list[str]:
    result = run_script(RAY_CLUSTER, args, clean_env(MRL_RAY_STATE_DIR="/tmp/mrl-ray-test", **env))
    assert result.returncode == 0, result.stderr
    (tag, argv), *rest = commands(result.stdout)
    assert not rest
    return argv


def test_ray_head_defaults_are_safe():
    argv = ray_dry(["start-head", "--port", "7100", "--num-gpus", "4"])
    assert argv[1:4] == ["start", "--block", "--head"]
    assert "--node-ip-address=127.0.0.1" in argv and "--include-dashboard=false" in argv
    assert "--port=7100" in argv and "--num-gpus=4" in argv and "--temp-dir=/tmp/mrl-ray-test/ray" in argv
    # Private ports on loopback, so that several single-node heads can share a machine.
    assert any(w.startswith("--ray-client-server-port=") for w in argv)
    assert any(w.startswith("--dashboard-agent-listen-port=") for w in argv)


def test_ray_head_address_and_dashboard_are_opt_in():
    argv = ray_dry(["start-head", "--dashboard"], MRL_BIND_ADDR="10.1.2.3")
    assert "--node-ip-address=10.1.2.3" in argv
    assert "--include-dashboard=true" in argv and "--dashboard-host=127.0.0.1" in argv
    assert not any(w.startswith("--ray-client-server-port=") for w in argv)


def test_ray_worker_joins_the_head():
    argv = ray_dry(["start-worker", "10.0.0.5:6379", "--num-gpus", "8", "--block", "--", "--object-store-memory=1"])
    assert argv[1:] == ["start", "--block", "--address=10.0.0.5:6379", "--num-gpus=8", "--object-store-memory=1"]
    result = run_script(RAY_CLUSTER, ["start-worker", "10.0.0.5"], clean_env())
    assert result.returncode == 2 and "not HEAD_IP:PORT" in result.stderr


def _stub_ray(tmp_path: Path) -> Path:
    """A bin folder whose `ray` only says it started (and then waits), beside a python that can run the
    script's helpers: ray_cluster.sh for real, without a Ray."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    ray = bin_dir / "ray"
    ray.write_text('#!/bin/sh\necho "Ray runtime started."\nexec sleep 60\n')
    ray.chmod(0o755)
    return bin_dir


def test_ray_head_makes_its_token_private(tmp_path):
    """The token file is made mode 0600 (Ray's own `get-auth-token --generate` wrote 0644), where
    RAY_AUTH_TOKEN_PATH says; an existing token that others may read is made private."""
    bin_dir, state = _stub_ray(tmp_path), tmp_path / "state"
    token = tmp_path / "shared" / "token"
    env = clean_env(MRL_PYTHON=str(bin_dir / "python"), HOME=str(tmp_path / "home"), RAY_AUTH_TOKEN_PATH=str(token))
    del env["MRL_DRY_RUN"]
    for _ in range(2):
        up = run_script(RAY_CLUSTER, ["start-head", "--state-dir", str(state)], env)
        assert up.returncode == 0, up.stderr
        assert run_script(RAY_CLUSTER, ["stop", "--state-dir", str(state)], env).returncode == 0
        assert oct(token.stat().st_mode & 0o777) == "0o600"
        assert re.fullmatch(r"[0-9a-f]{64}", token.read_text())
        token.chmod(0o644)  # a token someone made readable: the next start makes it private again
    assert "made the Ray auth token" in up.stderr and "private" in up.stderr
    assert not (tmp_path / "home" / ".ray").exists()  # nothing written where the path does not point


def test_agent_binds_the_node_address_it_is_given():
    from megatron_rl.parallel.torchrun import agent_argv, torchrun_command

    args = ["--nnodes", "2", "-m", "megatron_rl.trainer.loop", "spec.json", "--local-addr=x"]
    assert agent_argv(args, {"MRL_NODE_IP": "10.0.0.7"}) == ["--local-addr=10.0.0.7", *args]
    assert agent_argv(["--local-addr", "10.0.0.9", "-m", "m"], {"MRL_NODE_IP": "10.0.0.7"})[:2] == [
        "--local-addr", "10.0.0.9",
    ]  # fmt: skip
    assert agent_argv(args, {}) == args
    cmd = torchrun_command("m", [], 2)
    assert cmd[1:3] == ["-m", "megatron_rl.parallel.torchrun"]
    assert "--rdzv-endpoint=127.0.0.1:0" in cmd and "--local-addr=127.0.0.1" in cmd
