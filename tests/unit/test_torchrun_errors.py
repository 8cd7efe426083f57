"""How a failed torchrun job is summarised: the rank that failed first (torchrun's verdict) and the root cause."""

from __future__ import annotations

from megatron_rl.parallel.torchrun import first_failed_rank, log_failure, root_cause

KILLED_RANK_LOG = """\
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:32666: Connection reset by peer.
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
megatron_rl.trainer.loop FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-29_12:15:37
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 30850)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_12:15:35
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 30851)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 30851
============================================================
"""


def test_a_killed_rank_is_named_not_the_rank_that_lost_its_peer(tmp_path):
    assert first_failed_rank(KILLED_RANK_LOG) == "rank 1 exited -9: Signal 9 (SIGKILL) received by PID 30851"
    log = tmp_path / "trainer.log"
    log.write_text(KILLED_RANK_LOG)
    message = str(log_failure(log, "megatron_rl.trainer.loop", 1))
    assert message.splitlines()[1] == "first failure: rank 1 exited -9: Signal 9 (SIGKILL) received by PID 30851"
    assert "root cause: [rank0]: RuntimeError" in message


def test_a_log_without_torchrun_summary_has_no_first_failure():
    assert first_failed_rank("ValueError: bad config\n") == ""


def test_a_bad_input_error_is_its_own_message_without_a_traceback_tail(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text(
        'Traceback (most recent call last):\n  File "worker.py", line 3, in <module>\n'
        "[rank0]: megatron_rl.models.base.CheckpointError: /ckpt: model.layers.0.o_proj has shape (128, 64)\n"
        + KILLED_RANK_LOG
    )
    message = str(log_failure(log, "megatron_rl.workers.convert", 1))
    assert "root cause: [rank0]: megatron_rl.models.base.CheckpointError: /ckpt: model.layers.0.o_proj" in message
    assert "Traceback" not in message and "ChildFailedError" not in message


def test_an_internal_error_keeps_the_traceback_tail(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text(KILLED_RANK_LOG)
    assert "ChildFailedError" in str(log_failure(log, "megatron_rl.trainer.loop", 1))


PEER_FIRST_LOG = """\
[rank1]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2997. This is \
typically caused by a remote worker crashing.
[rank0]: megatron_rl.errors.CheckpointError: model.layers.1.mlp.experts.2.up_proj.weight: shape (3, 128), expected \
(64, 128)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 28522)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""


def test_the_failed_ranks_own_error_is_the_root_cause_not_a_peer_reporting_its_death():
    """Rank 1 printed its lost connection before rank 0 printed why it stopped: rank 0's error is the cause."""
    cause = root_cause(PEER_FIRST_LOG, "0")
    assert cause.startswith("[rank0]: megatron_rl.errors.CheckpointError: model.layers.1.mlp.experts.2.up_proj")
    assert root_cause(PEER_FIRST_LOG).startswith("[rank0]: megatron_rl.errors.CheckpointError")  # no rank known
    assert root_cause(PEER_FIRST_LOG.splitlines()[0]).startswith("[rank1]: RuntimeError")  # the only one there
