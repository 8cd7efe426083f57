"""The async lookahead: sized from the trainer's waits, within [0, max_staleness steps] (the buffer's side:
test_buffer.py)."""

from __future__ import annotations

import pytest

from megatron_rl.rollout.lookahead import Lookahead


def test_starts_one_step_ahead_and_ignores_the_start_up_wait():
    la = Lookahead(prompts_per_step=8, max_prompts=32)
    assert la.prompts == 8 and la.steps == 1.0
    assert la.observe(wait_s=30.0, cycle_s=None) == 8  # the first batch waits for vLLM's start: not a signal
    assert Lookahead(prompts_per_step=8, max_prompts=4).prompts == 4  # max_staleness below one step's prompts


def test_a_starved_trainer_raises_it_fast_up_to_the_bound():
    la = Lookahead(prompts_per_step=8, max_prompts=20)
    la.observe(0.0, None)
    seen = [la.observe(wait_s=0.5, cycle_s=1.0) for _ in range(5)]
    assert seen == [10, 12, 14, 16, 18]
    for _ in range(10):
        la.observe(0.5, 1.0)
    assert la.prompts == 20  # never past max_staleness steps


def test_a_wait_just_past_the_target_raises_it_one_prompt():
    la = Lookahead(prompts_per_step=16, max_prompts=64, target_idle=0.05)
    la.observe(0.0, None)
    assert [la.observe(wait_s=w, cycle_s=1.0) for w in (0.06, 0.1, 0.12, 0.2, 0.9)] == [17, 18, 20, 23, 27]


def test_a_fed_trainer_lowers_it_one_prompt_per_patience_cycles_down_to_zero():
    la = Lookahead(prompts_per_step=4, max_prompts=16, patience=3)
    la.observe(0.0, None)
    seen = [la.observe(wait_s=0.001, cycle_s=1.0) for _ in range(9)]
    assert seen == [4, 4, 3, 3, 3, 2, 2, 2, 1]
    for _ in range(30):
        la.observe(0.0, 1.0)
    assert la.prompts == 0  # synchronous is the floor


def test_a_wait_between_half_the_target_and_the_target_holds_it():
    la = Lookahead(prompts_per_step=4, max_prompts=16, target_idle=0.1, patience=1)
    la.observe(0.0, None)
    for _ in range(5):
        assert la.observe(wait_s=0.07, cycle_s=1.0) == 4


def _loop_model(late_every: int = 0, cycles: int = 200, edge=lambda cycle: 8, **kwargs) -> tuple[int, list[int]]:
    """A model of the loop: the trainer waits 20% of a cycle whenever the lookahead is under the edge (`edge(cycle)`
    prompts, one step by default: the missing groups are generated from scratch after it asks); with `late_every`
    k, every k-th batch is also late by 6% of its cycle whatever the lookahead. Returns the starved cycles and the
    lookahead after each cycle."""
    la = Lookahead(prompts_per_step=8, max_prompts=32, target_idle=0.05, patience=4, **kwargs)
    la.observe(0.0, None)
    starved_cycles, sizes = 0, []
    for cycle in range(cycles):
        starved = la.prompts < edge(cycle)
        starved_cycles += starved
        late = late_every and cycle % late_every == late_every - 1
        la.observe(wait_s=0.2 if starved else (0.06 if late else 0.0), cycle_s=1.0)
        sizes.append(la.prompts)
    return starved_cycles, sizes


def test_it_settles_at_the_edge_with_rare_waits():
    """The lookahead probes one prompt under the edge every `patience` cycles, so few cycles wait and the mean
    stays near one step."""
    waits, sizes = _loop_model()
    assert waits / 200 < 0.15, waits
    assert 7 <= sum(sizes) / len(sizes) <= 10, sum(sizes) / len(sizes)


def test_late_batches_now_and_then_are_read_as_a_share_of_the_time_not_one_by_one():
    """The loop on a busy machine: one batch in four is late by 6% of its cycle whatever the lookahead (1.5% of
    the time). Counted one by one such waits raised it a prompt each, past two steps; read as the share of time
    they are, the lookahead stays at the edge."""
    starved_cycles, sizes = _loop_model(late_every=4)
    assert starved_cycles / 200 < 0.15, starved_cycles
    assert 7 <= sum(sizes) / len(sizes) <= 10, sum(sizes) / len(sizes)
    assert max(sizes[100:]) <= 12, max(sizes[100:])


def test_failed_probes_back_off_so_the_edge_is_rarely_crossed():
    """Each probe under the edge splits a step's prompts into two engine bursts and makes the trainer wait: after
    failed probes the next waits twice as long (up to `max_backoff` times `patience`), so over 200 cycles a handful
    of probes fail where one cycle in ten did without the back-off."""
    starved_cycles, sizes = _loop_model()
    no_backoff, _ = _loop_model(max_backoff=1)
    assert starved_cycles <= 7 and no_backoff >= 18, (starved_cycles, no_backoff)
    assert sizes[-100:].count(8) >= 95  # at the edge, one step ahead


def test_after_backing_off_it_still_follows_an_edge_that_moves_down():
    """Probes that hold halve the back-off again: when half a step ahead becomes enough (cycle 100), the lookahead
    gets there, one successful probe after another."""
    _, sizes = _loop_model(cycles=400, edge=lambda cycle: 8 if cycle < 100 else 4)
    assert sizes[99] == 8 and min(sizes[100:]) >= 3 and sizes[-1] <= 5, (sizes[99], sizes[-1])


@pytest.mark.parametrize(
    "bad", [dict(prompts_per_step=0), dict(max_prompts=-1), dict(target_idle=1.0), dict(window=0), dict(max_backoff=0)]
)
def test_bad_settings_are_refused_by_name(bad):
    kwargs = dict(prompts_per_step=4, max_prompts=8) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        Lookahead(**kwargs)
