"""The autoscaling decision: proposals per signal, bounds, stabilization, step caps, zero."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvgate.operator.autoscale import Load, Recommendation, decide
from kvgate.operator.models import AutoscalingSpec, InvalidSpecError, parse_spec
from kvgate.protocol.admin import ExecutorState, ExecutorStatus, QueueLoad
from tests.operator.examples import FULL_SPEC

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def spec(**fields: Any) -> AutoscalingSpec:
    base: dict[str, Any] = {
        "minReplicas": 1,
        "maxReplicas": 16,
        "scaleDownStabilizationSeconds": 0,
        "maxScaleUpStep": 16,
        "maxScaleDownStep": 16,
    }
    return AutoscalingSpec.model_validate({**base, **fields})


def executor(running: int = 0, waiting: int = 0, used: int = 0, total: int = 100) -> ExecutorStatus:
    return ExecutorStatus(
        name="e", endpoint="ws://e", state=ExecutorState.READY, running_requests=running,
        waiting_requests=waiting, kv_blocks_used=used, kv_blocks_total=total,
    )  # fmt: skip


def load(lag: int = 0, unplaced: int = 0, *executors: ExecutorStatus) -> Load:
    return Load(QueueLoad(consumer_lag=lag, unplaced=unplaced), executors)


def replicas(s: AutoscalingSpec, current: int, reading: Load | None, **kw: Any) -> int:
    kw.setdefault("history", ())
    kw.setdefault("idle_since", None)
    return decide(s, current=current, load=reading, now=kw.pop("now", NOW), **kw).replicas


@pytest.mark.parametrize(
    ("fields", "reading", "expected"),
    [
        ({"targetConsumerLagPerExecutor": 10}, load(95), 10),  # ceil(95 / 10)
        ({"targetConsumerLagPerExecutor": 10}, load(100), 10),
        ({"targetWaitingPerExecutor": 2}, load(0, 3, executor(waiting=2), executor(waiting=1)), 3),
        # 2 executors at 90 % of their blocks, target 60 %: ceil(2 * 0.9 / 0.6) = 3
        ({"targetKvCacheUsage": 0.6}, load(1, 0, executor(used=90), executor(used=90)), 3),
        ({"targetKvCacheUsage": 0.5}, load(1, 0, executor(used=50), executor(used=50)), 2),
        # the most pressing signal wins
        ({"targetConsumerLagPerExecutor": 50, "targetWaitingPerExecutor": 1}, load(60, 7), 7),
        ({"targetConsumerLagPerExecutor": 10}, load(1000), 16),  # maxReplicas
        ({"targetConsumerLagPerExecutor": 10, "minReplicas": 3}, load(0), 3),  # minReplicas
    ],
)
def test_the_largest_proposal_within_bounds(
    fields: dict[str, Any], reading: Load, expected: int
) -> None:
    assert replicas(spec(**fields), 1, reading) == expected


def test_one_step_adds_and_removes_at_most_the_caps() -> None:
    s = spec(targetConsumerLagPerExecutor=1, maxScaleUpStep=3, maxScaleDownStep=2)
    assert replicas(s, 2, load(10)) == 5
    assert replicas(s, 10, load(1)) == 8


def test_scale_down_waits_for_the_highest_recommendation_of_its_window() -> None:
    s = spec(targetConsumerLagPerExecutor=10, scaleDownStabilizationSeconds=300)
    burst = (Recommendation(NOW - timedelta(seconds=200), 6),)
    assert replicas(s, 6, load(10), history=burst) == 6, "the burst is 200 s old: keep 6"
    later = NOW + timedelta(seconds=101)
    assert replicas(s, 6, load(10), history=burst, now=later) == 1, "window passed"


def test_scale_up_waits_for_the_lowest_recommendation_of_its_window() -> None:
    s = spec(targetConsumerLagPerExecutor=10, scaleUpStabilizationSeconds=60)
    quiet = (Recommendation(NOW - timedelta(seconds=30), 2),)
    assert replicas(s, 2, load(80), history=quiet) == 2
    sustained = (Recommendation(NOW - timedelta(seconds=30), 7),)
    assert replicas(s, 2, load(80), history=sustained) == 7  # min(7, 8)


def test_history_keeps_only_the_longest_window() -> None:
    s = spec(targetConsumerLagPerExecutor=10, scaleDownStabilizationSeconds=120)
    old = Recommendation(NOW - timedelta(seconds=500), 9)
    recent = Recommendation(NOW - timedelta(seconds=60), 4)
    decision = decide(s, current=4, load=load(10), history=(old, recent), idle_since=None, now=NOW)
    assert decision.history == (recent, Recommendation(NOW, 1))


def test_an_idle_pool_goes_to_zero_only_after_its_idle_time_and_wakes_on_one_record() -> None:
    s = spec(targetConsumerLagPerExecutor=10, minReplicas=0, scaleToZeroAfterSeconds=600)
    first = decide(s, current=2, load=load(0, 0, executor()), history=(), idle_since=None, now=NOW)
    assert (first.replicas, first.idle_since) == (1, NOW), "idle from now on; one stays"
    still = NOW + timedelta(seconds=599)
    assert replicas(s, 1, load(0), idle_since=NOW, now=still) == 1
    gone = NOW + timedelta(seconds=600)
    assert replicas(s, 1, load(0), idle_since=NOW, now=gone) == 0
    assert replicas(s, 0, load(0), idle_since=NOW, now=gone) == 0
    woken = decide(s, current=0, load=load(1), history=(), idle_since=NOW, now=gone)
    assert (woken.replicas, woken.idle_since) == (1, None)
    running = load(0, 0, executor(running=1))
    assert replicas(s, 1, running, idle_since=NOW, now=gone) == 1, "running work is not idle"


def test_without_a_reading_the_count_stays() -> None:
    s = spec(targetConsumerLagPerExecutor=10)
    decision = decide(s, current=5, load=None, history=(), idle_since=None, now=NOW)
    assert decision.replicas == 5
    assert "no load reading" in decision.reason


def test_the_reason_names_the_signal_and_the_bound() -> None:
    s = spec(targetConsumerLagPerExecutor=10, maxScaleUpStep=2)
    reason = decide(s, current=1, load=load(95), history=(), idle_since=None, now=NOW).reason
    assert "consumer lag 95" in reason
    assert "at most 2 more per step" in reason


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        ({"maxReplicas": 4}, "set at least one of targetConsumerLagPerExecutor"),
        (
            {"maxReplicas": 2, "minReplicas": 3, "targetWaitingPerExecutor": 4},
            "minReplicas (3) exceeds maxReplicas (2)",
        ),
        ({"maxReplicas": 2, "targetKvCacheUsage": 1.5}, "targetKvCacheUsage"),
        ({"targetWaitingPerExecutor": 4}, "maxReplicas"),
    ],
)
def test_bad_autoscaling_specs_are_refused_naming_the_field(
    autoscaling: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSpecError, match=re.escape(message)) as raised:
        parse_spec("p", {**FULL_SPEC, "autoscaling": autoscaling})
    assert "spec.autoscaling" in str(raised.value)
