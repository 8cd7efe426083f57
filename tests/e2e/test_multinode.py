"""Multi-node launches for real, on one machine, each ending in a finished run of the quickstart (3 steps):

- two torchrun agents (`--nnodes 2`, one rank each) meeting through the c10d rendezvous, beside a launcher with
  `--external-trainer` (the split a SLURM job uses);
- a two-node Ray cluster (`ray_cluster.sh start-head` on 127.0.0.2 and `start-worker` on 127.0.0.3: two loopback
  addresses that Ray keeps, so each node has one of its own), the engine placed on the worker node;
- `launch/slurm/train.sbatch` under a private single-machine Slurm (Debian's slurm-wlm: one slurmctld and two
  slurmd, `-N n1` and `-N n2`, tests/support/slurm/up.sh), 1 trainer node + 1 inference node.

Every process is started by the test in a session of its own and stopped by its process group afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.processes import titled_below

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RAY_CLUSTER = REPO / "launch" / "ray_cluster.sh"
SLURM = REPO / "tests" / "support" / "slurm"
RUN = ["configs/quickstart.yaml", "steps=3"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def short_dir():
    """Folders with short paths for Ray's state (its socket paths must stay under 107 bytes), removed after."""
    made: list[str] = []

    def make() -> Path:
        made.append(tempfile.mkdtemp(prefix="mrl-ray-", dir="/tmp"))
        return Path(made[-1])

    yield make
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A user's shell on this machine: no leftover launch, Slurm or Ray settings; Ray's token in the test's folder;
    gloo on loopback (every node is this machine)."""
    drop = ("MRL_", "SLURM_", "RAY_", "GLOO_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(
        MRL_PYTHON=sys.executable, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "ray_token"),
        GLOO_SOCKET_IFNAME="lo", RAY_USAGE_STATS_ENABLED="0",
    )  # fmt: skip
    env.update(extra)
    return env


class Processes:
    """Background processes, each in a session of its own; `stop` ends each whole group."""

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.procs = tmp_path, {}

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.tmp_path / f"{name}.log", "w")  # noqa: SIM115 (the child writes it until it ends)
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def wait(self, names: list[str], timeout_s: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        codes = {}
        while len(codes) < len(names):
            for name in names:
                if name not in codes and self.procs[name].poll() is not None:
                    codes[name] = self.procs[name].returncode
                    if codes[name] != 0:  # one side failed: the others would only wait for it
                        return codes
            assert time.monotonic() < deadline, f"still running after {timeout_s} s: {set(names) - set(codes)}"
            time.sleep(1)
        return codes

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _ray(args: list[str], env: dict[str, str], timeout_s: float = 400) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["bash", str(RAY_CLUSTER), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"exited ({proc.returncode}) before writing {path}; see {log}"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(1)


def _finished(run_dir: Path, steps: int = 3) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps, summary
    acc = summary["accounting"]
    assert acc["consumed"] == steps * 8
    assert acc["produced"] == acc["consumed"] + acc["dropped"] + acc["buffered"] + acc["in_flight"]
    return summary


def test_two_torchrun_agents_meet_through_c10d_rendezvous(tmp_path, short_dir):
    port, rdzv = _free_port(), _free_port()
    state, run_dir = short_dir(), tmp_path / "agents"
    env = _env(tmp_path)
    run = [*RUN, f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", "name=agents"]
    procs = Processes(tmp_path)
    try:
        _ray(["start-head", "--port", str(port), "--node-ip", "127.0.0.1", "--state-dir", str(state)], env)
        driver_env = {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # as launch/torchrun.sh exports for loopback
        launcher = procs.start(
            "launcher",
            [sys.executable, "-m", "megatron_rl.cli", "train", *run, "--ray-address", f"127.0.0.1:{port}",
             "--external-trainer", "--json"],
            driver_env,
        )  # fmt: skip
        spec = run_dir / "trainer_spec.json"
        _wait_for_file(spec, launcher, 900, "launcher.log")
        for node in (0, 1):
            procs.start(
                f"agent{node}",
                [sys.executable, "-m", "megatron_rl.parallel.torchrun", "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "--rdzv-id", "two-agents",
                 "--local-addr", "127.0.0.1", "--max-restarts", "0", "-m", "megatron_rl.trainer.loop", str(spec)],
                {**driver_env, "LOGLEVEL": "INFO"},  # torchrun then logs the rendezvous result
            )  # fmt: skip
        codes = procs.wait(["launcher", "agent0", "agent1"], 1200)
        assert codes == {"launcher": 0, "agent0": 0, "agent1": 0}, {n: procs.log(n)[-2000:] for n in codes}
    finally:
        procs.stop()
        subprocess.run(["bash", str(RAY_CLUSTER), "stop", "--state-dir", str(state)], env=env, timeout=120)
    _finished(run_dir)
    # torchrun's INFO lines carry a glog prefix ("I1202 18:57:16.003 ... api.py:553]   group_rank=0").
    ranks = {n: re.findall(r"\bgroup_rank=\d+", procs.log(n)) for n in ("agent0", "agent1")}
    assert sorted(r for found in ranks.values() for r in found) == ["group_rank=0", "group_rank=1"], ranks
    assert all("group_world_size=2" in procs.log(n) for n in ranks)


def test_a_two_node_ray_cluster_runs_the_engine_on_the_worker_node(tmp_path, short_dir):
    port = _free_port()
    head_state, worker_state, run_dir = short_dir(), short_dir(), tmp_path / "two-node-ray"
    env = _env(tmp_path)
    run = [*RUN, f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", "name=two-node-ray"]
    address = f"127.0.0.2:{port}"
    procs = Processes(tmp_path)
    on_worker = on_head = False
    try:
        # The head offers no CPUs: the engine (it needs some) can only go to the worker node.
        _ray(["start-head", "--port", str(port), "--node-ip", "127.0.0.2", "--num-cpus", "0",
              "--state-dir", str(head_state)], env)  # fmt: skip
        _ray(["start-worker", address, "--node-ip", "127.0.0.3", "--num-cpus", "2", "--state-dir", str(worker_state)],
             env)  # fmt: skip
        _ray(["wait", address, "2", "--timeout", "300"], env)
        head_pid, worker_pid = (int((d / "ray.pid").read_text()) for d in (head_state, worker_state))
        launcher = procs.start(
            "launcher", [sys.executable, "-m", "megatron_rl.cli", "train", *run, "--ray-address", address, "--json"], env
        )  # fmt: skip
        deadline = time.monotonic() + 1200
        while launcher.poll() is None:  # each node's processes descend from its `ray start --block`
            on_worker = on_worker or titled_below(worker_pid, "ray::VLLMEngine") is not None
            on_head = on_head or titled_below(head_pid, "ray::VLLMEngine") is not None
            assert time.monotonic() < deadline, "the run did not finish within 1200 s"
            time.sleep(1)
        assert launcher.returncode == 0, procs.log("launcher")[-3000:]
    finally:
        procs.stop()
        for state in (worker_state, head_state):
            subprocess.run(["bash", str(RAY_CLUSTER), "stop", "--state-dir", str(state)], env=env, timeout=120)
    _finished(run_dir)
    assert on_worker and not on_head, (on_worker, on_head)


def _slurm_missing() -> str:
    if os.geteuid() != 0:
        return "needs root (the Slurm daemons of the test cluster)"
    missing = [
        tool for tool in ("slurmctld", "slurmd", "sbatch", "squeue", "unshare", "nsenter") if not shutil.which(tool)
    ]
    return f"no {', '.join(missing)} (Debian: apt-get install slurm-wlm)" if missing else ""


@pytest.fixture()
def slurm(tmp_path):
    """A private two-node Slurm (n1, n2) on this machine; its SLURM_CONF."""
    if why := _slurm_missing():
        pytest.skip(why)
    folder = tmp_path / "slurm"
    try:  # down.sh even when up.sh fails or times out: its daemons may be running already
        up = subprocess.run(["bash", str(SLURM / "up.sh"), str(folder)], capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stderr[-3000:]
        yield str(folder / "slurm.conf")
    finally:
        subprocess.run(["bash", str(SLURM / "down.sh"), str(folder)], capture_output=True, timeout=120)


def test_train_sbatch_runs_under_a_real_slurm(slurm, tmp_path):
    """1 trainer node (n1: 2 ranks, c10d rendezvous at n1) + 1 inference node (n2: the Ray head, the launcher and
    the engine); both nodes are this machine, so Ray's nodes take 127.0.0.2 (head) and 127.0.0.3 (the trainer
    node's worker) and everything else loopback (MRL_IFNAME=lo). The batch script's `--gpus-per-node=8` is
    overridden on the sbatch line (the cluster has no GPUs)."""
    env = _env(
        tmp_path, SLURM_CONF=slurm, MRL_REPO=str(REPO), MRL_HEAD_IP="127.0.0.2", MRL_BIND_ADDR="127.0.0.3",
        MRL_IFNAME="lo", MRL_RAY_PORT=str(_free_port()), MRL_RDZV_PORT=str(_free_port()),
    )  # fmt: skip
    del env["GLOO_SOCKET_IFNAME"]  # the batch script derives it from MRL_IFNAME
    run = [
        *RUN, f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", "name=job", "cluster.trainer_nodes=1",
        "cluster.inference_nodes=1", "cluster.gpus_per_node=2",
    ]  # fmt: skip
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--export=ALL", f"--output={tmp_path}/job.out",
         "-D", str(REPO), str(REPO / "launch/slurm/train.sbatch"), *run],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 1500
    while subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still running; {tmp_path}/job.out"
        time.sleep(2)
    output = (tmp_path / "job.out").read_text(errors="replace")
    assert "run job finished" in output, output[-4000:]
    _finished(tmp_path / "job")
    # One log per step and node, named by the node's host name (%N: both nodes are this machine here).
    host = socket.gethostname().split(".")[0]
    assert (tmp_path / "job" / f"trainer.{host}.log").exists() and (tmp_path / "job" / f"ray-head.{host}.log").exists()
