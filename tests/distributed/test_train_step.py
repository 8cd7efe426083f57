"""The RL train step (Megatron DDP + optimizer + 1F1B schedule) on gloo processes, against an unsharded run.

Every case of a world size runs in one torchrun launch (model-parallel groups rebuilt between cases); the tests
then compare the reports. Tiny fp32 checkpoints, MoE aux loss off. Each case trains on fixed batches as the
learner does (`learner.train_batch`: mini-batches, KL in the reward, the guards), usually two of them (behaviour
logprobs = transformers' logprobs plus noise, so IS weights and clipping are exercised), and records the logprobs
of a fixed token batch before and after every batch. Cases with NaN and inf inputs show that such an update is
skipped and leaves every weight as it was.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_rl.parallel.torchrun import run_torchrun

WORKER = "tests.support.train_step_worker"
BATCH, SEQ, VOCAB = 8, 32, 512
LOSS_TOL = 1e-5
GRAD_NORM_RTOL = 1e-4
LOGPROB_TOL = 1e-4
PADDED_LOSS_TOL = 5e-5
"""Loss tolerance between a batch and the same batch with extra right padding: the longer sequences change the
matmul and attention shapes, so fp32 sums round differently (1.07e-5 seen at TP2 against a 0.29 loss). Without
the padding mask the update itself moves (logprobs after a step by 0.09, checked at LOGPROB_TOL)."""

DECOUPLED = {"loss": "decoupled_ppo", "correction": "tis", "is_cap": 2.0, "kl_coef": 0.1, "loss_agg": "token_mean"}
PPO_SEQ = {"loss": "ppo", "loss_agg": "seq_mean", "clip_low": 0.2, "clip_high": 0.28}
MINIBATCHES = {**DECOUPLED, "ppo_minibatches": 4, "ppo_epochs": 1}
ENTROPY = {**DECOUPLED, "entropy_coef": 0.05, "loss_agg": "seq_mean_token_sum"}
KL_REWARD = {**DECOUPLED, "kl_in": "reward", "kl_coef": 0.5, "kl_estimator": "k1", "advantage": "grpo"}
CISPO_DRGRPO = {"loss": "cispo", "correction": "mis", "is_cap": 1.5, "loss_agg": "seq_mean_token_sum_norm"}
SAMPLING = {"top_k": 400, "top_p": 0.9}
"""A mask that keeps about two thirds of the tiny models' near-uniform 512 tokens: random labels fall on both
sides of it, so the masked logprobs and the labels kept in the set although outside it are both exercised."""
# Linear decay over 4 steps: the second step's lr (0.75e-3) shows the scheduler state survives a resume.
OPTIM = {"lr": 1e-3, "lr_decay_style": "linear", "clip_grad": 1.0, "weight_decay": 0.01}
SEQUENTIAL = {"grouped_experts": False}  # Megatron's SequentialMLP loop for the routed experts
CLIPPED = {**OPTIM, "clip_grad": 0.01}  # below every step's gradient norm: the clip always acts

LAYOUTS = {
    "tp2": {"tp": 2},  # experts replicated over TP (ETP 1): their gradients are summed over the TP pair
    "tp2-etp2": {"tp": 2, "etp": 2},
    "ep2": {"ep": 2},
    "pp2": {"pp": 2},
    "tp2xep2": {"tp": 2, "ep": 2, "etp": 1},
}


PACKED_LAYOUTS = ("ep2", "tp2", "pp2")


def make_batch(hf_dir: str, seed: int, noise: float = 0.3, positive: bool = False) -> dict:
    """A right-padded batch of random prompts + responses with per-token old logprobs from transformers.

    The last sequence has an empty response (it must count for nothing); advantages are random (or all +1).
    """
    from megatron_rl.verify.parity import hf_logprobs

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.zeros(BATCH, SEQ - 1)
    lengths = torch.zeros(BATCH, dtype=torch.long)
    for i in range(BATCH):
        prompt = int(torch.randint(4, 12, (1,), generator=gen))
        response = 0 if i == BATCH - 1 else int(torch.randint(4, SEQ - prompt + 1, (1,), generator=gen))
        tokens[i, prompt + response :] = 0
        mask[i, prompt - 1 : prompt - 1 + response] = 1
        lengths[i] = prompt + response
    logprobs = hf_logprobs(hf_dir, tokens)
    behaviour = (logprobs + noise * torch.randn(logprobs.shape, generator=gen)) * mask
    ref = (logprobs + 0.2 * torch.randn(logprobs.shape, generator=gen)) * mask
    advantages = torch.ones(BATCH) if positive else torch.randn(BATCH, generator=gen)
    return {
        "tokens": tokens,
        "loss_mask": mask,
        "advantages": advantages,
        "behaviour_logprobs": behaviour,
        "ref_logprobs": ref,
        "lengths": lengths,
        "rewards": torch.rand(BATCH, generator=gen, dtype=torch.float64),
        "group_ids": torch.arange(BATCH) // 4,
    }


def _poisoned(path: str, out: Path, how: str) -> str:
    """The batch at `path` with one bad input, saved to `out`: a NaN or -inf behaviour logprob on a response
    token, an infinite advantage, or an advantage so large that the loss is finite but the gradient norm is not."""
    batch = torch.load(path)
    row, col = 0, int(batch["loss_mask"][0].nonzero()[0])
    if how in ("nan_logprob", "neginf_logprob"):
        batch["behaviour_logprobs"][row, col] = float("nan") if how == "nan_logprob" else float("-inf")
    elif how == "inf_advantage":
        batch["advantages"][row] = float("inf")
    elif how == "huge_advantage":
        batch["advantages"][row] = 1e37
    torch.save(batch, out)
    return str(out)


def _right_pad(path: str, out: Path, extra: int, seed: int) -> str:
    """The batch at `path` with `extra` more columns of random tokens (outside every mask) saved to `out`."""
    batch = torch.load(path)
    gen = torch.Generator().manual_seed(100 + seed)
    rows = batch["tokens"].shape[0]
    batch["tokens"] = torch.cat([batch["tokens"], torch.randint(3, VOCAB, (rows, extra), generator=gen)], dim=1)
    for key in ("loss_mask", "behaviour_logprobs", "ref_logprobs"):
        batch[key] = torch.nn.functional.pad(batch[key], (0, extra))
    torch.save(batch, out)
    return str(out)


def _case(name, root: Path, hf, layout, batches, eval_tokens, algo=DECOUPLED, mbs=2, **extra) -> dict:
    return {
        "name": name,
        "hf": hf,
        "layout": layout,
        "algo": algo,
        "optimizer": OPTIM,
        "micro_batch_size": mbs,
        "total_steps": 4,
        "moe_aux_loss_coeff": 0.0,
        "batches": batches,
        "eval_tokens": eval_tokens,
        "out": str(root / f"report-{name}.pt"),
        **extra,
    }


def build_cases(root: Path, tiny_dir) -> dict[int, list[dict]]:
    """Write the batches and return the cases of each world size."""
    moe, dense, ds = tiny_dir("qwen3_moe"), tiny_dir("qwen3"), tiny_dir("deepseek_v3")
    files = {}
    for key, hf, seed, kwargs in (
        ("moe0", moe, 0, {}),
        ("moe1", moe, 1, {}),
        ("ds0", ds, 5, {}),
        ("ds1", ds, 6, {}),
        ("dense0", dense, 2, {}),
        ("dense1", dense, 3, {}),
        ("learn", moe, 4, {"noise": 0.0, "positive": True}),
    ):
        files[key] = str(root / f"{key}.pt")
        torch.save(make_batch(hf, seed, **kwargs), files[key])
    eval_path = str(root / "eval.pt")
    torch.save(torch.randint(3, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(9)), eval_path)
    learn_tokens = str(root / "learn_tokens.pt")
    torch.save(torch.load(files["learn"])["tokens"], learn_tokens)
    moe_batches, dense_batches = [files["moe0"], files["moe1"]], [files["dense0"], files["dense1"]]
    padded_batches = [_right_pad(path, root / f"padded-{i}.pt", extra=8, seed=i) for i, path in enumerate(moe_batches)]
    ds_batches = [files["ds0"], files["ds1"]]
    ds_padded = [_right_pad(path, root / f"ds-padded-{i}.pt", extra=8, seed=i) for i, path in enumerate(ds_batches)]
    ckpt = str(root / "ckpt-ep2")
    bad = [
        _poisoned(files["moe1"], root / f"{how}.pt", how) for how in ("nan_logprob", "inf_advantage", "huge_advantage")
    ]
    neginf = _poisoned(files["moe1"], root / "neginf.pt", "neginf_logprob")

    def moe_case(name, layout, **kw):
        return _case(name, root, moe, layout, moe_batches, eval_path, **kw)

    def dense_case(name, layout, **kw):
        return _case(name, root, dense, layout, dense_batches, eval_path, **kw)

    packed = {"micro_batching": {"pack": True}}

    def grads(name):
        return {"grads_out": str(root / f"grads-{name}.pt")}

    world1 = [
        moe_case("moe-1x1x1", {}, mbs=4, **grads("moe-1x1x1")),
        # Packed: the same sequences end to end in fewer micro-batches; by tokens: 2 padded rows of 32 each.
        moe_case("moe-packed-1x1x1", {}, mbs=4, **packed, **grads("moe-packed-1x1x1")),
        moe_case("moe-tokens-1x1x1", {}, mbs=1, micro_batching={"tokens": 2 * SEQ}),
        moe_case("moe-1x1x1-mbs1", {}, mbs=1),
        moe_case("moe-ppo-1x1x1", {}, algo=PPO_SEQ),
        dense_case("dense-1x1x1", {}),
        _case("learn", root, moe, {}, [files["learn"]] * 4, learn_tokens, mbs=4, total_steps=4),
        moe_case("moe-aux-1x1x1", {}, moe_aux_loss_coeff=0.01),
        _case("moe-aux-padded-1x1x1", root, moe, {}, padded_batches, eval_path, moe_aux_loss_coeff=0.01),
        # DeepSeek-V3's router has expert bias (no aux loss): its update counts tokens per expert.
        _case("ds-1x1x1", root, ds, {}, ds_batches, eval_path, **grads("ds-1x1x1")),
        _case("ds-packed-1x1x1", root, ds, {}, ds_batches, eval_path, **packed, **grads("ds-packed-1x1x1")),
        _case("ds-padded-1x1x1", root, ds, {}, ds_padded, eval_path),
        moe_case("moe-mb4-1x1x1", {}, algo=MINIBATCHES, total_steps=8),
        moe_case("moe-proximal-pass-1x1x1", {}, mbs=4, proximal_pass=True),
        moe_case("moe-entropy-1x1x1", {}, algo=ENTROPY),
        moe_case("moe-klreward-1x1x1", {}, algo=KL_REWARD),
        moe_case("moe-cispo-1x1x1", {}, algo=CISPO_DRGRPO),
        _case("guard", root, moe, {}, [*bad, files["moe1"]], eval_path),
        _case("guard-clean", root, moe, {}, [files["moe1"]], eval_path),
        _case("neginf", root, moe, {}, [neginf], eval_path),
        moe_case("moe-mask-1x1x1", {}, sampling=SAMPLING),
        moe_case("moe-mask-mb4-1x1x1", {}, algo=MINIBATCHES, total_steps=8, sampling=SAMPLING),
        moe_case("moe-sequential-1x1x1", {}, mbs=4, build=SEQUENTIAL, **grads("moe-sequential-1x1x1")),
        _case(
            "ds-sequential-1x1x1", root, ds, {}, ds_batches, eval_path, build=SEQUENTIAL, **grads("ds-sequential-1x1x1")
        ),
        moe_case("clip-1x1x1", {}, optimizer=CLIPPED),
        moe_case("clip-megatron-1x1x1", {}, optimizer=CLIPPED, megatron_step=True),
    ]
    world2 = [moe_case(f"moe-{name}", layout) for name, layout in LAYOUTS.items() if name != "ep2"]
    world2 += [
        # Uninterrupted run at EP2 (two data-parallel ranks: the DistributedOptimizer shards its state), saved
        # after the first step; then the second step resumed from that checkpoint, at EP2, TP2 and PP2.
        moe_case("moe-ep2", LAYOUTS["ep2"], save_dir=ckpt, save_after=1),
        moe_case("moe-ppo-ep2", LAYOUTS["ep2"], algo=PPO_SEQ),
        moe_case("moe-aux-ep2", LAYOUTS["ep2"], moe_aux_loss_coeff=0.01),
        _case("moe-aux-padded-tp2", root, moe, {"tp": 2}, padded_batches, eval_path, moe_aux_loss_coeff=0.01),
        _case("moe-aux-padded-pp2", root, moe, {"pp": 2}, padded_batches, eval_path, moe_aux_loss_coeff=0.01),
        dense_case("dense-tp2", {"tp": 2}),
        dense_case("dense-pp2", {"pp": 2}),
        moe_case("moe-mb4-ep2", LAYOUTS["ep2"], algo=MINIBATCHES, mbs=1, total_steps=8),
        moe_case("moe-mb4-pp2", {"pp": 2}, algo=MINIBATCHES, total_steps=8),
        moe_case("moe-entropy-tp2", {"tp": 2}, algo=ENTROPY),
        moe_case("moe-klreward-ep2", LAYOUTS["ep2"], algo=KL_REWARD),
        moe_case("moe-cispo-ep2", LAYOUTS["ep2"], algo=CISPO_DRGRPO),
        _case("guard-ep2", root, moe, LAYOUTS["ep2"], [*bad, files["moe1"]], eval_path),
        moe_case("moe-mask-tp2", {"tp": 2}, sampling=SAMPLING),
        moe_case("moe-mask-mb4-tp2", {"tp": 2}, algo=MINIBATCHES, total_steps=8, sampling=SAMPLING),
        *(moe_case(f"moe-packed-{name}", LAYOUTS[name], **packed) for name in PACKED_LAYOUTS),
        moe_case("moe-packed-mb4-ep2", LAYOUTS["ep2"], algo=MINIBATCHES, mbs=1, total_steps=8, **packed),
        # One packed row a micro-batch: the second batch's shares pack into 4 and 3 rows, so one replica runs an
        # empty micro-batch, with the load-balancing loss on.
        moe_case("moe-aux-packed-ep2", LAYOUTS["ep2"], mbs=1, moe_aux_loss_coeff=0.01, **packed),
        # Megatron's allgather dispatcher takes one micro-batch shape over the EP group: four packed rows a
        # micro-batch, the second batch's shares pack into 4 and 3 rows (3 alone: gloo aborts, 512 vs 384 bytes).
        moe_case(
            "moe-allgather-packed-ep2",
            LAYOUTS["ep2"],
            mbs=4,
            build={"moe_dispatcher": "allgather"},
            micro_batching={"pack": True, "uniform": True},
        ),  # fmt: skip
        moe_case("moe-packed-mask-mb4-tp2", {"tp": 2}, algo=MINIBATCHES, total_steps=8, sampling=SAMPLING, **packed),
        moe_case("moe-sequential-ep2", LAYOUTS["ep2"], build=SEQUENTIAL),
        moe_case("clip-ep2", LAYOUTS["ep2"], optimizer=CLIPPED),
        moe_case("clip-megatron-ep2", LAYOUTS["ep2"], optimizer=CLIPPED, megatron_step=True),
    ]
    world2 += [
        _case(f"resume-{name}", root, moe, LAYOUTS[name], moe_batches[1:], eval_path, load_dir=ckpt)
        for name in ("ep2", "tp2", "pp2")
    ]
    # Later pipeline stages under sequence parallelism take the padding mask as their TP rank's sequence slice.
    world4 = [
        _case(
            "moe-aux-padded-tp2pp2", root, moe, {"tp": 2, "pp": 2}, padded_batches, eval_path, moe_aux_loss_coeff=0.01
        )
    ]
    return {1: world1, 2: world2, 4: world4}


@pytest.fixture(scope="module")
def reports(tiny_dir, tmp_path_factory):
    """Run every case (one launch per world size); name -> {"steps": [...], "evals": [...]}."""
    root = tmp_path_factory.mktemp("train-step")
    cases = build_cases(root, tiny_dir)
    for world, world_cases in sorted(cases.items()):
        spec = root / f"spec{world}.json"
        spec.write_text(json.dumps({"cases": world_cases}))
        run_torchrun(WORKER, [str(spec)], world, timeout_s=120 * len(world_cases), log_path=root / f"log{world}.txt")
    out = {}
    for case in (c for world_cases in cases.values() for c in world_cases):
        out[case["name"]] = torch.load(case["out"])
        out[case["name"]]["loss_mask"] = torch.load(case["batches"][0])["loss_mask"]
    out["_root"] = root
    return out


def _max_eval_diff(a: dict, b: dict, index: int) -> float:
    return float((a["evals"][index] - b["evals"][index]).abs().max())


def _check_match(ref: dict, got: dict, boundary_flips: float = 0.0, loss_tol: float = LOSS_TOL) -> None:
    """Same loss, grad norm and stats at every step; same logprobs before and after each step.

    `boundary_flips`: the fraction of positions whose logprob may differ by more than LOGPROB_TOL (at most 1e-2).
    With the top-p mask a token whose cumulative probability sits at the boundary can be in the kept set at one
    layout and out of it at another (logits differ by ~1e-7 between layouts), which moves that position's
    normaliser by about the token's probability: a discontinuity of top-p, not a sharding error.
    """
    for i, (want, have) in enumerate(zip(ref["steps"], got["steps"], strict=True)):
        assert abs(want["loss"] - have["loss"]) <= loss_tol, (i, want["loss"], have["loss"])
        assert abs(want["grad_norm"] - have["grad_norm"]) <= GRAD_NORM_RTOL * want["grad_norm"], (i, want, have)
        assert want["lr"] == pytest.approx(have["lr"], rel=1e-12)
        for key in (
            "ppo/clip_frac", "is/weight_mean", "mismatch/abs_diff_mean", "batch/response_tokens", "policy/entropy",
            "kl/reward_penalty_mean",
        ):  # fmt: skip
            if key in want:
                assert abs(want[key] - have[key]) <= 1e-4, (i, key, want[key], have[key])
    for i in range(len(ref["evals"])):
        diff = (ref["evals"][i] - got["evals"][i]).abs()
        over = float((diff > LOGPROB_TOL).float().mean())
        assert over <= boundary_flips and float(diff.max()) <= max(LOGPROB_TOL, 1e-2 * (boundary_flips > 0)), (
            i, float(diff.max()), over,
        )  # fmt: skip
    # The update is far larger than the tolerance, so agreement after it is not trivial.
    assert float((ref["evals"][1] - ref["evals"][0]).abs().max()) > 100 * LOGPROB_TOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layouts_match_unsharded(reports, layout):
    _check_match(reports["moe-1x1x1"], reports[f"moe-{layout}"])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_dense_layouts_match_unsharded(reports, layout):
    """Qwen3 dense with tied embeddings: PP2 exercises the embedding gradient all-reduce between stages."""
    _check_match(reports["dense-1x1x1"], reports[f"dense-{layout}"])


def test_ppo_seq_mean_matches_unsharded(reports):
    """PPO clipped against the behaviour policy, seq_mean over two data-parallel ranks (global sequence count)."""
    ref = reports["moe-ppo-1x1x1"]
    _check_match(ref, reports["moe-ppo-ep2"])
    assert ref["steps"][0]["ppo/clip_frac"] > 0.05  # the clip is active on some tokens


def test_moe_aux_loss_is_applied_and_matches_unsharded(reports):
    """With moe_aux_loss_coeff > 0 Megatron's load-balancing loss adds router gradients (the reported policy
    loss is unchanged); the same micro-batch composition at EP2 (two DP ranks) gives the same step."""
    off, on = reports["moe-1x1x1"], reports["moe-aux-1x1x1"]
    assert on["steps"][0]["loss"] == pytest.approx(off["steps"][0]["loss"], abs=LOSS_TOL)
    # The router gradients are a small part of the grad norm, but Adam's first update moves every router weight
    # by about lr whatever its gradient's size, so the aux loss shows in the logprobs after the step.
    assert _max_eval_diff(off, on, 0) <= LOGPROB_TOL  # same start
    assert _max_eval_diff(off, on, 1) > 10 * LOGPROB_TOL, _max_eval_diff(off, on, 1)
    _check_match(reports["moe-aux-1x1x1"], reports["moe-aux-ep2"])


@pytest.mark.parametrize(
    "name", ["moe-aux-padded-1x1x1", "moe-aux-padded-tp2", "moe-aux-padded-pp2", "moe-aux-padded-tp2pp2"]
)
def test_right_padding_changes_nothing_with_the_aux_loss(reports, name):
    """RL batches are padded to their longest response: the routers must leave padding out of the
    load-balancing loss (Megatron's padding mask), or extra padding would change the update."""
    padded, plain = reports[name], reports["moe-aux-1x1x1"]
    for want, have in zip(plain["steps"], padded["steps"], strict=True):
        assert abs(want["loss"] - have["loss"]) <= PADDED_LOSS_TOL, (want["loss"], have["loss"])
        assert abs(want["grad_norm"] - have["grad_norm"]) <= GRAD_NORM_RTOL * want["grad_norm"], (want, have)
    for i in range(len(plain["evals"])):
        assert _max_eval_diff(plain, padded, i) <= LOGPROB_TOL, (i, _max_eval_diff(plain, padded, i))


def test_right_padding_changes_nothing_in_the_expert_bias_update(reports):
    """DeepSeek-V3's expert bias moves by the sign of each expert's token count against the mean: padding
    tokens must not count (the padding mask, with parallel/patches.py's fix of Megatron's mask broadcast)."""
    plain, padded = reports["ds-1x1x1"], reports["ds-padded-1x1x1"]
    for want, have in zip(plain["steps"], padded["steps"], strict=True):
        assert abs(want["loss"] - have["loss"]) <= PADDED_LOSS_TOL, (want["loss"], have["loss"])
    for i in range(len(plain["evals"])):
        assert _max_eval_diff(plain, padded, i) <= LOGPROB_TOL, (i, _max_eval_diff(plain, padded, i))


def test_an_empty_packed_micro_batch_leaves_the_aux_loss_finite(reports):
    """A replica whose share packs into fewer rows runs empty micro-batches (every replica runs as many as the one
    that needs the most): the routers' load-balancing loss must add nothing there, not a NaN that has the guard
    skip the whole update (megatron-core 0.16.1 divided by the micro-batch's zero real tokens)."""
    ours, plain = reports["moe-aux-packed-ep2"], reports["moe-aux-1x1x1"]
    assert ours["steps"][1]["batch/micro_batches"] == 4  # 4 rows on one replica, 3 on the other
    for step in ours["steps"]:
        assert step["guard/skipped"] == 0 and math.isfinite(step["grad_norm"]), step
    assert ours["steps"][0]["loss"] == pytest.approx(plain["steps"][0]["loss"], abs=LOSS_TOL)


def test_packed_micro_batches_take_one_shape_with_the_allgather_dispatcher(reports):
    """With the allgather dispatcher every replica's packed micro-batches hold as many rows (it gathers tokens
    over the EP group in one shape), and the run matches the unsharded padded one."""
    ours = reports["moe-allgather-packed-ep2"]
    assert [step["batch/micro_batches"] for step in ours["steps"]] == [1, 1]
    _check_match(reports["moe-1x1x1"], ours)


def test_micro_batch_size_invariance(reports):
    """micro_batch_size 1 (8 micro-batches) and 4 (2 micro-batches) give the same step."""
    _check_match(reports["moe-1x1x1"], reports["moe-1x1x1-mbs1"])


def _check_gradients(tmp_root: Path, ref: str, got: str) -> float:
    """The largest difference between two cases' reduced first-step gradients (every parameter)."""
    a, b = torch.load(tmp_root / f"grads-{ref}.pt"), torch.load(tmp_root / f"grads-{got}.pt")
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("family", ["moe", "ds"])
def test_packed_sequences_give_the_padded_losses_and_gradients(reports, family):
    """Sequences packed end to end (attention within each, positions from each start) train as padded ones:
    the same loss at each step, and the same reduced gradient of every parameter at the first (within 1e-5)."""
    plain, packed = reports[f"{family}-1x1x1"], reports[f"{family}-packed-1x1x1"]
    for want, have in zip(plain["steps"], packed["steps"], strict=True):
        assert abs(want["loss"] - have["loss"]) <= LOSS_TOL, (want["loss"], have["loss"])
    diff = _check_gradients(reports["_root"], f"{family}-1x1x1", f"{family}-packed-1x1x1")
    print(f"{family}: packed vs padded, largest gradient difference {diff:.3g}")
    assert diff <= 1e-5
    assert packed["steps"][0]["batch/micro_batches"] <= plain["steps"][0]["batch/micro_batches"]
    assert packed["steps"][0]["batch/token_fill"] >= plain["steps"][0]["batch/token_fill"]


@pytest.mark.parametrize("family", ["moe", "ds"])
def test_grouped_experts_train_as_megatrons_sequential_mlp(reports, family):
    """The routed experts in one grouped matmul per linear (`GroupedLocalExperts`, the CPU default) against
    Megatron's SequentialMLP loop: the same losses, logprobs after every step and first-step gradients."""
    grouped, sequential = reports[f"{family}-1x1x1"], reports[f"{family}-sequential-1x1x1"]
    assert all(step["grouped_mm_calls"] > 0 for step in grouped["steps"])
    assert all(step["grouped_mm_calls"] == 0 for step in sequential["steps"])
    _check_match(sequential, grouped)
    diff = _check_gradients(reports["_root"], f"{family}-sequential-1x1x1", f"{family}-1x1x1")
    print(f"{family}: grouped vs sequential experts, largest gradient difference {diff:.3g}")
    assert diff <= 1e-6


def test_grouped_experts_at_ep2_train_as_megatrons_sequential_mlp(reports):
    """At EP2 (four local experts a rank, tokens from both ranks) the grouped experts match SequentialMLP."""
    assert all(step["grouped_mm_calls"] > 0 for step in reports["moe-ep2"]["steps"])
    _check_match(reports["moe-sequential-ep2"], reports["moe-ep2"])


@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
def test_packed_sequences_match_unsharded_padded(reports, layout):
    """Packed at EP2 (the replicas agree on one micro-batch count), TP2 (sequence parallel) and PP2."""
    _check_match(reports["moe-1x1x1"], reports[f"moe-packed-{layout}"])


def test_packed_minibatches_and_sampling_mask_match_padded(reports):
    """Packed proximal and training forwards over four mini-batches (EP2), and with the top-p mask (TP2)."""
    _check_match(reports["moe-mb4-1x1x1"], reports["moe-packed-mb4-ep2"])
    _check_match(reports["moe-mask-mb4-tp2"], reports["moe-packed-mask-mb4-tp2"], boundary_flips=1e-2)


def test_micro_batches_sized_by_tokens(reports):
    """`micro_batch_tokens` 64 over rows of 32: two sequences per micro-batch, the same step as by count."""
    _check_match(reports["moe-1x1x1"], reports["moe-tokens-1x1x1"])


def test_stats_are_sane(reports):
    step = reports["moe-1x1x1"]["steps"][0]
    assert step["update_successful"] == 1.0
    assert step["batch/sequences"] == BATCH
    assert step["lr"] == pytest.approx(1e-3)
    assert reports["moe-1x1x1"]["steps"][1]["lr"] == pytest.approx(0.75e-3)
    # The whole-batch loss the stats owner recomputes equals the sum of the micro-batch shares.
    assert step["loss/total"] == pytest.approx(step["loss"], abs=1e-6)
    # Proximal == current at the first step of a batch: the PPO ratio is exactly 1, the IS weights are not.
    assert step["ppo/ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert 0 < step["is/truncated_frac"] < 0.5
    assert 0.05 < step["mismatch/abs_diff_mean"] < 0.5  # the behaviour noise (0.3) shows up
    assert step["kl/penalty"] > 0


@pytest.mark.parametrize("layout", ["1x1x1", "ep2"])
def test_one_gradient_norm_per_update_gives_megatrons_update(reports, layout):
    """The update readies the gradients and takes their norm once, then clips and steps (`step_clipped_by`);
    Megatron's `step()` does both again: the same norm (the worker asserts it) and the same weights after every
    step, with the clip acting (at EP2 the dense and expert parts are DistributedOptimizers)."""
    ours, megatron = reports[f"clip-{layout}"], reports[f"clip-megatron-{layout}"]
    assert all(step["grad_norm"] > 10 * CLIPPED["clip_grad"] for step in ours["steps"])
    for want, have in zip(megatron["evals"], ours["evals"], strict=True):
        assert torch.equal(want, have)
    assert float((ours["evals"][1] - ours["evals"][0]).abs().max()) > 100 * LOGPROB_TOL
    # On CPU torch's AdamW runs its fused kernel (`use_fused_cpu_adam`) in both chained parts (dense, expert).
    assert ours["fused_adam"] == [True, True]


def test_learning_increases_logprob_of_rewarded_responses(reports):
    """Repeated steps on one batch with positive advantages raise the mean logprob of its responses."""
    report = reports["learn"]
    mask = report["loss_mask"].bool()
    means = [float(e[mask].mean()) for e in report["evals"]]
    assert all(b > a for a, b in zip(means, means[1:])), means
    assert means[-1] - means[0] > 0.5, means
    # The step's own stat (mean logprob at the start of each step) tells the same story.
    starts = [s["batch/mean_logprob"] for s in report["steps"]]
    assert starts[0] == pytest.approx(means[0], abs=1e-4)
    assert all(b > a for a, b in zip(starts, starts[1:])), starts


def test_resume_from_checkpoint_is_exact(reports):
    """Save model + DistributedOptimizer + scheduler after step 1 at EP2, load at EP2, take step 2: identical."""
    full, resumed = reports["moe-ep2"], reports["resume-ep2"]
    assert resumed["steps"][0]["loss"] == full["steps"][1]["loss"]
    assert resumed["steps"][0]["grad_norm"] == full["steps"][1]["grad_norm"]
    assert resumed["steps"][0]["lr"] == full["steps"][1]["lr"]
    assert torch.equal(resumed["evals"][0], full["evals"][1])
    assert torch.equal(resumed["evals"][1], full["evals"][2])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_resume_at_another_layout(reports, layout):
    """The same checkpoint (optimizer state `fully_reshardable`) resumed at another layout: same second step."""
    full, resumed = reports["moe-ep2"], reports[f"resume-{layout}"]
    assert abs(resumed["steps"][0]["loss"] - full["steps"][1]["loss"]) <= LOSS_TOL
    assert resumed["steps"][0]["grad_norm"] == pytest.approx(full["steps"][1]["grad_norm"], rel=GRAD_NORM_RTOL)
    assert resumed["steps"][0]["lr"] == full["steps"][1]["lr"]
    assert _max_eval_diff({"evals": resumed["evals"]}, {"evals": full["evals"][1:]}, 0) <= LOGPROB_TOL
    assert _max_eval_diff({"evals": resumed["evals"]}, {"evals": full["evals"][1:]}, 1) <= LOGPROB_TOL


def test_minibatches_make_the_clip_act_and_match_across_layouts(reports):
    """Four updates per batch: the proximal policy is the batch's start, so the clip acts from the second update
    on (one update per batch never clips: ratio exactly 1); the mini-batches are the same global rows at EP2
    (data parallel) and PP2, so the runs match."""
    ref = reports["moe-mb4-1x1x1"]
    first = ref["steps"][0]
    assert first["ppo/updates"] == 4 and first["batch/sequences"] == BATCH
    assert first["ppo/clip_frac"] > 0 and first["ppo/ratio_max"] > 1.0
    assert reports["moe-1x1x1"]["steps"][0]["ppo/clip_frac"] == 0
    _check_match(ref, reports["moe-mb4-ep2"])
    _check_match(ref, reports["moe-mb4-pp2"])


def test_one_minibatch_takes_the_proximal_logprobs_from_the_training_forward(reports):
    """The same step with a separate proximal forward (labels path) and from the training forward's own logits
    (vocab-parallel cross entropy): the same logprobs, so the same update."""
    single, two_pass = reports["moe-1x1x1"], reports["moe-proximal-pass-1x1x1"]
    for want, have in zip(single["steps"], two_pass["steps"], strict=True):
        assert abs(want["loss"] - have["loss"]) <= 1e-6 and have["ppo/ratio_max"] == pytest.approx(1.0, abs=1e-6)
        assert want["grad_norm"] == pytest.approx(have["grad_norm"], rel=1e-5)
    assert _max_eval_diff(single, two_pass, 2) <= 1e-5


def test_entropy_is_vocab_parallel_and_its_bonus_trains(reports):
    """The entropy (metric and bonus) at TP2, each rank holding half of the vocabulary, equals TP1's; the bonus
    changes the update (its gradient flows through the all-reduces)."""
    ref = reports["moe-entropy-1x1x1"]
    # The second step's loss carries the bonus over the vocabulary, summed in float32 over two halves at TP2 after
    # an update: it has differed by 1.0e-5 to 1.9e-5 (7e-5 relative) from run to run, so 5e-5 as for padding.
    _check_match(ref, reports["moe-entropy-tp2"], loss_tol=PADDED_LOSS_TOL)
    step = ref["steps"][0]
    assert 0 < step["policy/entropy"] < math.log(VOCAB) and step["loss/entropy_bonus"] > 0
    plain = reports["moe-1x1x1"]["steps"][0]
    assert step["policy/entropy"] == pytest.approx(plain["policy/entropy"], rel=1e-5)  # same start, same metric
    assert _max_eval_diff(ref, reports["moe-1x1x1"], 1) > 10 * LOGPROB_TOL


def test_kl_in_the_reward_matches_across_layouts(reports):
    ref = reports["moe-klreward-1x1x1"]
    assert ref["steps"][0]["kl/reward_penalty_mean"] != 0 and "kl/penalty" not in ref["steps"][0]
    _check_match(ref, reports["moe-klreward-ep2"])


def test_cispo_with_the_dr_grpo_aggregation_matches_across_layouts(reports):
    _check_match(reports["moe-cispo-1x1x1"], reports["moe-cispo-ep2"])


@pytest.mark.parametrize("name", ["guard", "guard-ep2"])
def test_non_finite_updates_are_skipped_and_change_nothing(reports, name):
    """A NaN behaviour logprob, an infinite advantage, and an advantage of 1e37 (finite loss, infinite gradient
    norm): each update is skipped, every weight stays bit for bit, the LR schedule does not move, and the clean
    batch after them trains exactly as in a run that saw only it."""
    guard, clean = reports[name], reports["guard-clean"]
    for step in guard["steps"][:3]:
        assert step["guard/skipped"] == 1 and step["update_successful"] == 0, step
    assert not math.isfinite(guard["steps"][0]["loss"]) and not math.isfinite(guard["steps"][1]["loss"])
    assert math.isfinite(guard["steps"][2]["loss"]) and not math.isfinite(guard["steps"][2]["grad_norm"])
    assert all(torch.equal(guard["evals"][0], e) for e in guard["evals"][1:4])
    last = guard["steps"][3]
    assert last["guard/skipped"] == 0 and last["lr"] == clean["steps"][0]["lr"]
    assert abs(last["loss"] - clean["steps"][0]["loss"]) <= LOSS_TOL
    assert _max_eval_diff({"evals": guard["evals"][3:]}, clean, 1) <= LOGPROB_TOL


def test_a_minus_infinity_behaviour_logprob_trains(reports):
    """-inf from the engine is a ratio clamped at exp(20) (truncated by TIS), not a NaN: the update goes on."""
    step = reports["neginf"]["steps"][0]
    assert step["guard/skipped"] == 0 and math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])


@pytest.mark.parametrize(
    "algo",
    [
        DECOUPLED,
        {**DECOUPLED, "correction": "mis", "is_cap": 1.2, "loss_agg": "seq_mean", "is_normalizer": "kept"},
        {**DECOUPLED, "correction": "seq_mis", "is_cap": 1.5},
        {**DECOUPLED, "correction": "geo_mis", "is_cap": 1.1, "veto_max": 2.0, "is_normalizer": "kept"},
        {**DECOUPLED, "loss": "gspo", "loss_agg": "seq_mean_token_sum", "entropy_coef": 0.1},
        {**DECOUPLED, "loss": "cispo", "loss_agg": "seq_mean_token_sum_norm", "kl_estimator": "k3+"},
        PPO_SEQ,
    ],
    ids=["tis-token", "mis-seq-kept", "seqmis-token", "geomis-veto", "gspo-seqsum", "cispo-drgrpo", "ppo-seq"],
)
def test_global_normaliser_decomposition(algo):
    """No processes: the micro-batch shares (2 DP shares x micro-batches, global denominators) sum to the
    whole-batch `policy_loss` (+ KL, + entropy), and so do their gradients, also when a masking correction drops
    tokens."""
    from megatron_rl.algorithms.objective import policy_loss
    from megatron_rl.config import AlgorithmConfig
    from megatron_rl.trainer.batch import TrainBatch, data_parallel_shard
    from megatron_rl.trainer.train_step import local_counts, loss_spec, micro_batch_loss, normalizers_from_counts

    cfg = AlgorithmConfig(**algo)
    spec = loss_spec(cfg, max_new_tokens=11)
    gen = torch.Generator().manual_seed(0)
    b, s = 8, 12
    mask = (torch.rand(b, s - 1, generator=gen) < 0.6).float()
    mask[3] = 0  # an empty sequence
    current = -torch.rand(b, s - 1, generator=gen) * 3
    entropy = torch.rand(b, s - 1, generator=gen) * 2
    batch = TrainBatch(
        tokens=torch.zeros(b, s, dtype=torch.long),
        loss_mask=mask,
        advantages=torch.randn(b, generator=gen),
        behaviour_logprobs=current + 0.3 * torch.randn(b, s - 1, generator=gen),
        proximal_logprobs=current + 0.1 * torch.randn(b, s - 1, generator=gen),
        ref_logprobs=current + 0.2 * torch.randn(b, s - 1, generator=gen),
    )
    whole_lp, whole_ent = current.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    whole, _ = policy_loss(
        spec, whole_lp, batch.proximal_logprobs, batch.behaviour_logprobs, batch.advantages, mask,
        ref_logprobs=batch.ref_logprobs, entropy=whole_ent,
    )  # fmt: skip
    whole.backward()
    shares = [data_parallel_shard(batch, r, 2) for r in range(2)]
    norms = normalizers_from_counts(sum(local_counts(share, spec) for share in shares))
    parts_lp, parts_ent = current.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    total = 0.0
    for r, share in enumerate(shares):
        for m, mb in enumerate(share.split(2)):
            rows = slice(r * 4 + m * 2, r * 4 + m * 2 + 2)
            loss, _ = micro_batch_loss(parts_lp[rows], mb, spec, norms, parts_ent[rows])
            total = total + loss
    total.backward()
    assert float(total.detach()) == pytest.approx(float(whole.detach()), abs=1e-6)
    assert torch.allclose(parts_lp.grad, whole_lp.grad, atol=1e-7)
    if cfg.entropy_coef > 0:
        assert torch.allclose(parts_ent.grad, whole_ent.grad, atol=1e-7)
    else:  # a metric only: no gradient into the entropy
        assert parts_ent.grad is None and whole_ent.grad is None


def test_replica_rows_give_every_layout_the_same_minibatches():
    from megatron_rl.trainer.batch import replica_rows

    rows = [replica_rows(16, r, 2, 4).tolist() for r in range(2)]
    assert rows == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert replica_rows(16, 1, 2).tolist() == list(range(8, 16))  # one mini-batch: the contiguous slice
    with pytest.raises(ValueError, match="ppo_minibatches=3"):
        replica_rows(16, 0, 2, 3)


def test_the_sampling_mask_matches_across_tp_and_changes_the_update(reports):
    """The engines' top-k / top-p mask on every logprob (training forward, proximal pass of the mini-batches,
    the eval logprobs) at TP2, where the kept set needs the gathered vocabulary rows, equals the unsharded run;
    it changes the loss but not the entropy (of the unmasked distribution), and raises every logprob (a label
    outside the set is kept in it, so nothing is -inf)."""
    masked, plain = reports["moe-mask-1x1x1"], reports["moe-1x1x1"]
    _check_match(masked, reports["moe-mask-tp2"], boundary_flips=0.01)
    _check_match(reports["moe-mask-mb4-1x1x1"], reports["moe-mask-mb4-tp2"], boundary_flips=0.01)
    first = masked["steps"][0]
    assert first["policy/entropy"] == pytest.approx(plain["steps"][0]["policy/entropy"], rel=1e-6)
    assert abs(first["loss"] - plain["steps"][0]["loss"]) > 1e-3
    assert 0.05 < first["policy/outside_mask_frac"] < 0.8, first["policy/outside_mask_frac"]
    assert reports["moe-mask-tp2"]["steps"][0]["policy/outside_mask_frac"] == first["policy/outside_mask_frac"]
    assert "policy/outside_mask_frac" not in plain["steps"][0]
    lifted = masked["evals"][0] - plain["evals"][0]
    assert bool(torch.isfinite(masked["evals"][0]).all()) and float(lifted.min()) > 0
