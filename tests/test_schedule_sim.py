"""Schedules compared in a deterministic simulation (``schedule_sim``) with one stage per
device (no virtual stages): forward = backward = one unit, messages that take time to arrive.

With zero latency every schedule reaches the theory, (p − 1)/(m + p − 1). With
latency the message-driven queue must not fall behind 1F1B: an earlier version
bounded only stage 0's microbatches in flight, so a middle stage ran a forward
that had just arrived before a waiting backward, and at p=4, m=16 with a 5%
latency it idled 0.29 of the step against 1F1B's 0.19.
"""

import pytest
from schedule_sim import simulate

from axonn_jax.runtime.pipeline import schedules
from axonn_jax.runtime.pipeline.timeline import bubble_theory


@pytest.mark.parametrize("stages,microbatches", [(2, 8), (4, 4), (4, 16), (8, 32)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "message"])
def test_every_schedule_reaches_the_theory_without_latency(schedule, stages, microbatches):
    sim = simulate(schedule, stages, 1, microbatches)
    assert sim.idle == pytest.approx(bubble_theory(stages, microbatches), abs=1e-9)


@pytest.mark.parametrize("stages,microbatches", [(2, 8), (4, 16), (8, 32)])
@pytest.mark.parametrize("latency", [0.01, 0.05])
def test_message_driven_is_never_behind_1f1b_under_latency(stages, microbatches, latency):
    one_f_one_b = simulate("1f1b", stages, 1, microbatches, latency=latency)
    message = simulate("message", stages, 1, microbatches, latency=latency)
    same_memory = simulate("message", stages, 1, microbatches, latency=latency, limit=stages)
    assert message.idle <= one_f_one_b.idle + 1e-9
    assert same_memory.idle <= one_f_one_b.idle + 1e-9
    assert max(same_memory.peak.values()) <= stages  # 1F1B's residual memory


def test_default_limit_stays_near_the_theory_at_4_stages_and_16_microbatches():
    theory = bubble_theory(4, 16)
    for latency in (0.01, 0.05):  # message hops of 1–5% of a task
        assert simulate("message", 4, 1, 16, latency=latency).idle <= theory + 0.01
    assert simulate("1f1b", 4, 1, 16, latency=0.05).idle > theory + 0.02  # what the extra microbatch buys


@pytest.mark.parametrize("limit", [None, 4, 6])
def test_stage_s_keeps_at_most_limit_minus_s_microbatches(limit):
    stages, bound = 4, limit or schedules.default_limit(4)
    sim = simulate("message", stages, 1, 16, latency=0.05, limit=limit)
    for s in range(stages - 1):
        assert sim.peak[s] <= max(bound - s, 1)
    assert sim.peak[0] == bound  # stage 0 uses its whole bound (the pipeline is fed)
