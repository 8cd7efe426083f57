"""On-policy distillation, the fast parts: the advantage math against a float64 reference, the config's checks,
the tokenizer check, teacher logprobs on samples and in the batch, and the driver requeueing a prompt whose
teacher scoring failed (the real buffer in this process, stand-in engines as in test_driver.py)."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time

import numpy as np
import pytest
import torch
from ray.exceptions import RayActorError

from megatron_rl.algorithms.distill import distill_advantages, reverse_kl_sums, top_k_kl
from megatron_rl.config import ConfigError, load_config
from megatron_rl.models.routes import TOP_PAD_LOGPROB, decode_teacher_top, encode_teacher_top, teacher_top_row
from megatron_rl.rollout.buffer import RolloutBuffer
from megatron_rl.rollout.driver import GenerationError, TeacherError
from megatron_rl.rollout.tasks import PromptStream
from megatron_rl.rollout.teacher import (
    LATENCY_KEY,
    VERSION_KEY,
    TeacherMismatchError,
    TeacherScorer,
    check_teacher,
    response_logprobs,
)
from megatron_rl.rollout.types import Group, Sample
from megatron_rl.trainer.batch import groups_to_batch
from tests.unit.test_driver import CountingTask, StandInEngine, _drive_until, _running_driver

QUICKSTART = "configs/quickstart.yaml"


def _logprobs(seed: int, shape=(3, 6)) -> torch.Tensor:
    return -torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


MASK = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("use_reward", [True, False])
@pytest.mark.parametrize("per_token", [False, True])
def test_distill_advantages_against_a_float64_reference(use_reward, per_token):
    student, teacher = _logprobs(0), _logprobs(1)
    teacher[~MASK] = float("nan")  # padding is never read
    reward = torch.tensor([0.5, -1.0, 2.0]) if not per_token else _logprobs(2).float()
    got = distill_advantages(reward, student.float(), teacher.float(), MASK, kl_coef=0.3, use_reward=use_reward)
    assert got.shape == MASK.shape and torch.isfinite(got).all()
    for b in range(3):
        for t in range(6):
            if not MASK[b, t]:
                assert got[b, t] == 0
                continue
            base = float(reward[b] if not per_token else reward[b, t]) if use_reward else 0.0
            expected = base - 0.3 * (float(student[b, t]) - float(teacher[b, t]))
            assert math.isclose(float(got[b, t]), expected, rel_tol=1e-6, abs_tol=1e-6)


def test_distill_advantages_are_detached_and_zero_when_student_is_teacher():
    student = _logprobs(3).float().requires_grad_()
    got = distill_advantages(torch.zeros(3), student, student.detach().clone(), MASK, kl_coef=1.0, use_reward=False)
    assert not got.requires_grad
    assert got.abs().max() == 0


def test_reverse_kl_sums():
    student, teacher = _logprobs(4), _logprobs(5)
    total, tokens, k3, largest = reverse_kl_sums(student, teacher, MASK).tolist()
    diff = (student - teacher)[MASK].double()
    assert tokens == int(MASK.sum())
    assert math.isclose(total, float(diff.sum()), rel_tol=1e-12)
    assert math.isclose(k3, float((torch.exp(-diff) - 1 + diff).sum()), rel_tol=1e-9) and k3 > 0
    assert math.isclose(largest, float(diff.abs().max()), rel_tol=1e-12)
    assert reverse_kl_sums(student, teacher, torch.zeros_like(MASK)).tolist() == [0.0, 0.0, 0.0, 0.0]
    assert reverse_kl_sums(student, student, MASK)[2] == 0  # k3 of equal distributions


# ---------------------------------------------------------------------------------------------------------------
# Config


def _distill(*overrides: str):
    return load_config(QUICKSTART, ["distill.teacher=hf", "distill.teacher_path=/teacher", *overrides])


def test_distill_config_defaults_and_a_complete_teacher():
    assert not load_config(QUICKSTART).distill.enabled
    cfg = _distill("distill.use_reward=false", "distill.kl_coef=0.5")
    assert cfg.distill.enabled and cfg.distill.kl_coef == 0.5 and not cfg.distill.use_reward
    snapshot = load_config(QUICKSTART, ["distill.teacher=snapshot", "distill.refresh_every=3"]).distill
    assert snapshot.enabled and snapshot.refresh_every == 3 and not snapshot.teacher_path


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["distill.teacher=hf"], "distill.teacher=hf needs distill.teacher_path"),
        (["distill.teacher_path=/t"], "distill.teacher_path='/t' is set but distill.teacher=none"),
        (["distill.teacher=snapshot", "distill.teacher_path=/t"], "snapshot copies the policy .* has no use"),
        (["distill.teacher=hf", "distill.teacher_path=/t", "distill.refresh_every=2"], "teacher=snapshot only"),
        (["distill.teacher=hf", "distill.teacher_path=/t", "distill.kl_coef=-1"], "kl_coef"),
        (["distill.teacher=hf", "distill.teacher_path=/t", "distill.teacher=hx"], "teacher"),
        (
            ["distill.teacher=hf", "distill.teacher_path=/t", "distill.use_reward=false", "distill.kl_coef=0"],
            "leaves nothing to train on",
        ),
        (
            ["distill.teacher=hf", "distill.teacher_path=/t", "distill.use_reward=false", "algorithm.dynamic_sampling=true"],
            "dynamic_sampling drops groups .* distill.use_reward=false",
        ),
        (
            ["distill.teacher=hf", "distill.teacher_path=/t", "distill.use_reward=false", "algorithm.kl_coef=0.1",
             "algorithm.kl_in=reward"],
            "kl_in=reward .* distill.use_reward=false",
        ),
    ],
)  # fmt: skip
def test_distill_config_refuses_what_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(QUICKSTART, overrides)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both_paths(tiny_dir, tmp_path):
    student = tiny_dir("qwen3_moe")
    check_teacher(student, tiny_dir("mixtral"))  # another family, the same shipped tokenizer: accepted
    teacher = tmp_path / "teacher"
    shutil.copytree(student, teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TeacherMismatchError) as err:
        check_teacher(student, str(teacher))
    assert str(teacher) in str(err.value) and student in str(err.value)
    assert "differ at 2 token(s)" in str(err.value)
    with pytest.raises(TeacherMismatchError, match=f"distill.teacher_path='{tmp_path}/none': no config.json"):
        check_teacher(student, str(tmp_path / "none"))


# ---------------------------------------------------------------------------------------------------------------
# Samples and the batch


def _sample(index: int, teacher: list[float] | None) -> Sample:
    return Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [0, 0, 0], prompt_index=index, teacher_logprobs=teacher)


def test_teacher_logprobs_travel_in_samples_checkpoints_and_the_batch():
    group = Group(0, [_sample(0, [-1.0, -2.0, -3.0]), _sample(0, [-0.5, -0.25, -0.125])])
    again = Group.from_dict(json.loads(json.dumps(group.to_dict())))
    assert again.samples[1].teacher_logprobs == [-0.5, -0.25, -0.125]
    old = _sample(0, None).to_dict()
    del old["teacher_logprobs"]  # a buffer checkpoint written before the field existed
    assert Sample.from_dict(old).teacher_logprobs is None
    batch = groups_to_batch([again], "grpo", tp=1)
    assert batch.teacher_logprobs.shape == batch.loss_mask.shape
    assert batch.teacher_logprobs[1, 1:4].tolist() == [-0.5, -0.25, -0.125]  # position t predicts token t + 1
    assert batch.teacher_logprobs[batch.loss_mask == 0].abs().sum() == 0
    assert groups_to_batch([Group(0, [_sample(0, None)])], "grpo", tp=1).teacher_logprobs is None
    with pytest.raises(ValueError, match="1 of 2 samples have no teacher logprobs"):
        groups_to_batch([Group(0, [_sample(0, [-1.0, -1.0, -1.0]), _sample(0, None)])], "grpo", tp=1)
    with pytest.raises(ValueError, match="3 response tokens but 2 teacher logprobs"):
        _sample(0, [-1.0, -1.0])


def test_response_logprobs_takes_the_response_tokens_and_refuses_bad_scores():
    sample = _sample(7, None)
    assert response_logprobs(sample, [-9.0, -1.0, -2.0, -3.0]) == [-1.0, -2.0, -3.0]
    with pytest.raises(TeacherError, match="prompt 7: the teacher returned 3 logprobs, not 4"):
        response_logprobs(sample, [-1.0, -2.0, -3.0])
    with pytest.raises(TeacherError, match="prompt 7: the teacher's logprob of response token 1 is nan"):
        response_logprobs(sample, [-9.0, -1.0, float("nan"), -3.0])


# ---------------------------------------------------------------------------------------------------------------
# The driver with a teacher that fails


class StandInTeacher(StandInEngine):
    """Scores every token -0.5 at weight version `version`; raises `errors[prompt]` (once per entry) instead."""

    version = 0

    async def _score(self, sequences, top_k=0):
        pending = self.errors.get(sequences[0][1])
        if pending:
            raise pending.pop(0)
        return {"version": self.version, "logprobs": [[-0.5] * (len(s) - 1) for s in sequences]}

    @property
    def score_versioned(self):
        return _Remote(self._score)

    @property
    def weight_version(self):
        return _Remote(self._weight_version)

    async def _weight_version(self):
        return self.version


class _Remote:
    def __init__(self, fn):
        self.remote = fn


def test_a_failed_teacher_scoring_requeues_the_prompt_and_loses_no_sample():
    teacher = StandInTeacher({1: [RuntimeError("teacher vLLM error")], 2: [asyncio.TimeoutError()]})
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()))
    driver = _running_driver(
        buffer, CountingTask(), StandInEngine(), 1, "distill.teacher=hf", "distill.teacher_path=/t"
    )
    driver.teacher = TeacherScorer({"teacher-0": teacher}, restart=None, timeout_s=5.0, max_restarts=0)
    asyncio.run(_drive_until(driver, lambda: buffer.stats()["buffered"] >= 4))
    groups = buffer.get_batch(4, 0, 1.0)
    assert sorted(g.prompt_index for g in groups) == [0, 1, 2, 3]  # 1 and 2 came back and were scored
    for g in groups:
        assert g.samples[0].teacher_logprobs == [-0.5] and LATENCY_KEY in g.samples[0].metadata
    assert driver.stats.teacher_failures == 2 and driver.stats.requeued == 2
    assert driver.teacher.report()["failures"] == 2
    acc = buffer.check_accounting()
    assert acc["dropped"] == 0 and acc["produced"] == acc["consumed"] + acc["buffered"] + acc["in_flight"]


class HungTeacher(StandInTeacher):
    """Answers neither a scoring nor a health call."""

    async def _score(self, sequences, top_k=0):
        await asyncio.sleep(3600)

    async def _health(self, through_core: bool = False) -> dict:
        await asyncio.sleep(3600)


def test_a_hung_teacher_is_restarted_and_its_prompt_requeued(monkeypatch):
    monkeypatch.setattr("megatron_rl.rollout.teacher.PROBE_TIMEOUT_S", 0.2)
    restarted = []

    def restart(name: str):
        restarted.append(name)
        return StandInTeacher()

    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()))
    driver = _running_driver(buffer, CountingTask(), StandInEngine(), 1)
    driver.teacher = TeacherScorer({"teacher-0": HungTeacher()}, restart, timeout_s=0.5, max_restarts=1)
    asyncio.run(_drive_until(driver, lambda: buffer.stats()["buffered"] >= 4))
    assert restarted == ["teacher-0"] and driver.teacher.down == {}
    assert driver.teacher.restarts == {"teacher-0": 1}
    assert len(buffer.get_batch(4, 0, 1.0)) == 4 and buffer.check_accounting()["dropped"] == 0
    assert driver.stats.teacher_failures >= 1 and driver.stats.requeued == driver.stats.teacher_failures


def test_a_teacher_that_dies_past_its_restarts_stops_the_run():
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()))
    driver = _running_driver(buffer, CountingTask(), StandInEngine(), 1)
    dead = StandInTeacher({i: [RayActorError(error_msg="the teacher's actor died")] for i in range(8)})
    driver.teacher = TeacherScorer({"teacher-0": dead}, restart=None, timeout_s=5.0, max_restarts=0)
    with pytest.raises(
        GenerationError,
        match=r"teacher-0 is down .*actor died.* after 0 restart\(s\) \(rollout.max_engine_restarts=0\)",
    ):
        asyncio.run(_drive_until(driver, lambda: False))


def test_a_restarted_snapshot_teacher_scores_again_only_once_refreshed_to_its_version():
    """A snapshot teacher that scored at version 3 dies; its restart starts from the checkpoint (version 0) and is
    used only once the trainer's refresh brought it to 3 or later, so no sample is scored by older weights."""
    old = StandInTeacher({2: [RayActorError(error_msg="teacher killed")]})
    old.version = 3
    fresh = RefreshedLater()

    def restart(name: str):
        fresh.refreshed_at = time.monotonic() + 1.0  # the trainer's refresh, brought forward by the restart
        return fresh

    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()))
    driver = _running_driver(buffer, CountingTask(), StandInEngine(), 1)
    driver.teacher = TeacherScorer({"teacher-0": old}, restart, timeout_s=5.0, max_restarts=1, refresh_wait_s=10.0)
    asyncio.run(_drive_until(driver, lambda: buffer.stats()["buffered"] >= 4))
    groups = buffer.get_batch(4, 0, 1.0)
    versions = {g.prompt_index: g.samples[0].metadata[VERSION_KEY] for g in groups}
    assert versions.get(2) == 4 and set(versions.values()) <= {3, 4}, versions
    assert fresh.polls >= 2 and fresh.scored_before_refresh == 0
    assert driver.teacher.restarts == {"teacher-0": 1} and driver.teacher.versions == {"teacher-0": 4}
    assert buffer.check_accounting()["dropped"] == 0 and driver.stats.teacher_failures == 1


class RefreshedLater(StandInTeacher):
    """A restarted snapshot teacher: version 0 until `refreshed_at`, then 4."""

    refreshed_at = math.inf
    polls = scored_before_refresh = 0

    @property
    def version(self):
        return 4 if time.monotonic() >= self.refreshed_at else 0

    async def _weight_version(self):
        self.polls += 1
        return self.version

    async def _score(self, sequences, top_k=0):
        self.scored_before_refresh += self.version == 0
        return await super()._score(sequences, top_k)


def test_a_restarted_teacher_the_trainer_never_refreshes_stops_the_run():
    old = StandInTeacher({2: [RayActorError(error_msg="teacher killed")]})
    old.version = 2
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()))
    driver = _running_driver(buffer, CountingTask(), StandInEngine(), 1)
    driver.teacher = TeacherScorer(
        {"teacher-0": old}, lambda name: StandInTeacher(), timeout_s=5.0, max_restarts=1, refresh_wait_s=0.5
    )
    with pytest.raises(GenerationError, match="restarted at weight version 0, and the trainer did not bring it to"):
        asyncio.run(_drive_until(driver, lambda: False))


# ---------------------------------------------------------------------------------------------------------------
# The top-k KL loss


def test_top_k_kl_is_the_kl_of_the_renormalised_top_k_and_ignores_padding():
    gen = torch.Generator().manual_seed(3)
    student = torch.randn(2, 5, 4, generator=gen).log_softmax(-1) - 0.3  # logprobs of 4 of a larger vocabulary
    teacher = torch.randn(2, 5, 4, generator=gen).log_softmax(-1) - 0.2
    s, t = student.log_softmax(-1).double(), teacher.log_softmax(-1).double()
    forward = (t.exp() * (t - s)).sum(-1)
    reverse = (s.exp() * (s - t)).sum(-1)
    assert torch.allclose(top_k_kl(student, teacher, "forward").double(), forward, atol=1e-6)
    assert torch.allclose(top_k_kl(student, teacher, "reverse").double(), reverse, atol=1e-6)
    assert float(top_k_kl(teacher, teacher, "reverse").abs().max()) < 1e-6 and float(forward.min()) > 0
    padded_t = torch.cat([teacher, torch.full((2, 5, 2), TOP_PAD_LOGPROB)], -1)  # two entries the engine lacked
    padded_s = torch.cat([student, torch.zeros(2, 5, 2)], -1).requires_grad_()
    for kind, expected in (("forward", forward), ("reverse", reverse)):
        got = top_k_kl(padded_s, padded_t, kind)
        assert torch.allclose(got.double(), expected, atol=1e-6), kind
        (grad,) = torch.autograd.grad(got.sum(), padded_s)
        assert torch.isfinite(grad).all() and float(grad[..., 4:].abs().max()) == 0
    with pytest.raises(ValueError, match="expected forward or reverse"):
        top_k_kl(student, teacher, "jsd")


class _Lp:
    def __init__(self, logprob, rank):
        self.logprob, self.rank = logprob, rank


def test_teacher_top_rows_travel_encoded_and_come_back_in_the_batch():
    entry = {7: _Lp(-0.1, 1), 3: _Lp(-2.5, 2), 9: _Lp(-9.0, 57)}  # the scored token (9) ranked 57th
    assert teacher_top_row(entry, 2) == ([7, 3], [-0.1, -2.5])
    assert teacher_top_row(entry, 3) == ([7, 3, 0], [-0.1, -2.5, TOP_PAD_LOGPROB])
    ids = np.array([[5, 1], [2, 8], [4, 4]], dtype=np.int32)
    logprobs = np.array([[-0.5, -1.0], [-0.2, -3.0], [-0.7, -0.9]], dtype=np.float32)
    entry = json.loads(json.dumps(encode_teacher_top(ids, logprobs)))
    back = decode_teacher_top(entry)
    assert (back[0] == ids).all() and (back[1] == logprobs).all()
    sample, other = _sample(0, [-1.0, -1.0, -1.0]), _sample(0, [-1.0, -1.0, -1.0])
    sample.metadata["teacher_top"] = other.metadata["teacher_top"] = entry
    batch = groups_to_batch([Group(0, [sample, other])], "grpo", tp=1)
    assert batch.teacher_top_ids.shape == batch.teacher_top_logprobs.shape == (2, 5, 2)  # [B, S-1, k]: S padded to 6
    assert batch.teacher_top_ids[0, 1:4].tolist() == ids.tolist()  # position t predicts token t + 1
    assert batch.teacher_top_logprobs[0, 1:4].tolist() == logprobs.tolist()
    assert bool((batch.teacher_top_logprobs[0, 0] <= TOP_PAD_LOGPROB / 2).all())  # the prompt's position
    assert batch.select(slice(1, 2)).teacher_top_ids.shape == (1, 5, 2)
    del other.metadata["teacher_top"]
    with pytest.raises(ValueError, match="1 of 2 samples carry no teacher top-k"):
        groups_to_batch([Group(0, [sample, _sample(0, [-1.0, -1.0, -1.0])])], "grpo", tp=1)
