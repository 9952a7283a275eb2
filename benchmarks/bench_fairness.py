"""Fair sharing between tenants and deadline order, against today's order, in simulated time.

    PYTHONPATH=. python benchmarks/bench_fairness.py [--mode flood|shares|deadlines|all] [--json]

One simulated executor (``kvgate.sim.cluster``: the real scheduler, a step cost proportional to
its work) serves open-loop Poisson arrivals at one priority; each mode runs the same arrivals
under today's order (``fairness: off``, ``deadline_order: false``) and the new one:

- ``flood``: a light tenant at 10 % of the executor's capacity and a heavy one at ten times its
  rate (together over capacity). Reported: the light tenant's time to first token p50/p99 with
  the flood, against its solo run (goal: p99 within 20 %), split into the wait before its first
  step (the step in flight at arrival, under fair order) and that step's length; and a lower
  bound for any scheduler that keeps the flood's batch decoding: a step cannot be interrupted,
  so a light request waits at least for the rest of a decode-only step of ``max_num_seqs - 1``
  rows (its arrival's phase in it), then takes at least its solo time.
- ``shares``: both tenants over their share (light at 60 % of capacity, heavy at 600 %),
  weights 1:1 and 1:3. Reported: each tenant's share of the tokens served (prompt and output)
  in the steps where both had requests waiting, against its weight (goal: within 10 %).
- ``deadlines``: arrivals at 110 % of capacity for a minute, a third due 3 s after arrival, the
  rest 120 s. Reported: deadline misses (expired, or finished late), FCFS against EDF.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.admission_service.placement import Ask, ExecutorView
from kvgate.protocol.enums import FinishReason
from kvgate.protocol.step import StepPlan
from kvgate.scheduler.config import Fairness, SchedulerConfig
from kvgate.scheduler.events import StepReport
from kvgate.scheduler.request import RequestStatus
from kvgate.sim.cluster import (
    Cluster,
    ClusterRequest,
    ClusterResult,
    Node,
    PlanObserver,
    StepCost,
    build_node,
)
from kvgate.sim.counting_executor import CountingExecutor

VOCAB = 32_000
PROMPT_TOKENS = (150, 250)
OUTPUT_TOKENS = (60, 140)
# Requests per second one executor serves at these sizes, measured (``--calibrate``).
CAPACITY_RPS = 18.0
TODAY = SchedulerConfig(
    max_num_seqs=16, max_num_batched_tokens=1024, prefill_chunk_size=512, async_scheduling=False
)


class _Only:
    def rank(self, ask: Ask, executors: Sequence[Node]) -> Sequence[ExecutorView]:
        return list(executors)


def _arrivals(
    rng: random.Random,
    tenant: str,
    rate_rps: float,
    duration_s: float,
    *,
    deadline: tuple[float, float] | None = None,
) -> list[ClusterRequest]:
    """Poisson arrivals; ``deadline``: (share of requests, seconds after arrival) for the tight
    ones, the rest due 120 s after arrival."""
    out: list[ClusterRequest] = []
    at = rng.expovariate(rate_rps)
    index = 0
    while at < duration_s:
        due = None
        if deadline is not None:
            tight_share, tight_s = deadline
            due = at + (tight_s if rng.random() < tight_share else 120.0)
        out.append(
            ClusterRequest(
                request_id=f"{tenant}-{index}",
                prompt_token_ids=tuple(
                    rng.randrange(VOCAB) for _ in range(rng.randint(*PROMPT_TOKENS))
                ),
                max_tokens=rng.randint(*OUTPUT_TOKENS),
                arrival_s=at,
                tenant=tenant,
                deadline_s=due,
                seed=index,
            )
        )
        index += 1
        at += rng.expovariate(rate_rps)
    return out


def _run(
    config: SchedulerConfig,
    requests: list[ClusterRequest],
    on_plan: PlanObserver | None = None,
    on_step: Callable[[float, list[Node]], None] | None = None,
) -> tuple[ClusterResult, Node]:
    node = build_node(
        "e0",
        config,
        CountingExecutor(name="e0", num_blocks=4096, block_size=16),
        enable_prefix_caching=False,
    )
    node.on_plan = on_plan
    cluster = Cluster([node], _Only(), on_step=on_step)
    for request in requests:
        cluster.submit(request)
    return cluster.run(), node


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _ttfts(result: ClusterResult, tenant: str) -> list[float]:
    return [
        o.ttft_s
        for o in result.outcomes.values()
        if o.request.tenant == tenant and o.ttft_s is not None
    ]


# --- flood -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FloodFigures:
    order: str
    light_ttft_p50_s: float
    light_ttft_p99_s: float
    solo_ttft_p50_s: float
    solo_ttft_p99_s: float
    p99_vs_solo: float
    # The light requests' wait for the step in flight and their own first prefill step.
    wait_p99_s: float
    own_step_p99_s: float
    bound_p99_s: float  # the lower bound above (the same for both orders)


class _FirstSteps:
    """Each request's first prefill step: when it started and how long it took."""

    def __init__(self) -> None:
        self.cost = StepCost()  # the cluster's
        self.now = 0.0
        self.first: dict[str, tuple[float, float]] = {}

    def tick(self, now: float, nodes: list[Node]) -> None:
        self.now = now  # the time the next steps start at

    def __call__(self, node: Node, plan: StepPlan, report: StepReport) -> None:
        for row in plan.prefill_rows:
            self.first.setdefault(row.request_id, (self.now, self.cost.seconds(report)))


def _bound(config: SchedulerConfig, solo: ClusterResult) -> list[float]:
    """Per light request: its solo time to first token plus the rest of a decode-only step of
    ``max_num_seqs - 1`` rows in flight when it arrives (steps back to back from time 0)."""
    step = StepCost().seconds(StepReport(step_id=0, decode_rows=config.max_num_seqs - 1))
    out = []
    for outcome in solo.outcomes.values():
        if outcome.ttft_s is None:
            continue
        rest = step - math.fmod(outcome.request.arrival_s, step)
        out.append(rest + outcome.ttft_s)
    return out


def flood(seed: int, duration_s: float) -> list[FloodFigures]:
    light_rps = 0.1 * CAPACITY_RPS
    light = _arrivals(random.Random(seed), "light", light_rps, duration_s)
    heavy = _arrivals(random.Random(seed + 1), "heavy", 10 * light_rps, duration_s)
    rows = []
    fair = TODAY.model_copy(update={"fairness": Fairness.TOKENS})
    for order, config in (("today", TODAY), ("fair", fair)):
        solo_result = _run(config, light)[0]
        solo = _ttfts(solo_result, "light")
        steps = _FirstSteps()
        mixed_result, _ = _run(config, light + heavy, steps, steps.tick)
        mixed = _ttfts(mixed_result, "light")
        waits, own = [], []
        for request in light:
            started, took = steps.first[request.request_id]
            waits.append(started - request.arrival_s)
            own.append(took)
        p99, solo_p99 = _percentile(mixed, 0.99), _percentile(solo, 0.99)
        rows.append(
            FloodFigures(
                order,
                _percentile(mixed, 0.5),
                p99,
                _percentile(solo, 0.5),
                solo_p99,
                p99 / solo_p99,
                _percentile(waits, 0.99),
                _percentile(own, 0.99),
                _percentile(_bound(config, solo_result), 0.99),
            )
        )
    return rows


# --- shares ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ShareFigures:
    order: str
    weights: str
    light_share: float
    light_target: float
    heavy_share: float
    heavy_target: float
    worst_off_by: float  # the larger |share / target - 1|
    backlogged_steps: int


class _ShareMeter:
    """Tokens served by tenant in the steps where both tenants had requests waiting."""

    def __init__(self) -> None:
        self.tokens: Counter[str] = Counter()
        self.steps = 0

    def __call__(self, node: Node, plan: StepPlan, report: StepReport) -> None:
        requests = node.scheduler.state.requests
        waiting = {r.tenant for r in requests.values() if r.status is RequestStatus.WAITING}
        if not {"light", "heavy"} <= waiting:
            return
        self.steps += 1
        for row in plan.prefill_rows:
            request = requests.get(row.request_id)
            if request is not None:
                self.tokens[request.tenant] += row.token_end - row.token_start
        for rid in plan.decode.request_ids:
            request = requests.get(rid)
            if request is not None:
                self.tokens[request.tenant] += 1


def shares(seed: int, duration_s: float) -> list[ShareFigures]:
    light = _arrivals(random.Random(seed), "light", 0.6 * CAPACITY_RPS, duration_s)
    heavy = _arrivals(random.Random(seed + 1), "heavy", 6.0 * CAPACITY_RPS, duration_s)
    rows = []
    for heavy_weight in (1.0, 3.0):
        weights = {"light": 1.0, "heavy": heavy_weight}
        fair = TODAY.model_copy(update={"fairness": Fairness.TOKENS, "tenant_weights": weights})
        for order, config in (("today", TODAY), ("fair", fair)):
            meter = _ShareMeter()
            _run(config, light + heavy, meter)
            total = sum(meter.tokens.values()) or 1
            light_share = meter.tokens["light"] / total
            light_target = 1.0 / (1.0 + heavy_weight)
            heavy_target = 1.0 - light_target
            rows.append(
                ShareFigures(
                    order,
                    f"1:{heavy_weight:g}",
                    light_share,
                    light_target,
                    1.0 - light_share,
                    heavy_target,
                    max(
                        abs(light_share / light_target - 1),
                        abs((1.0 - light_share) / heavy_target - 1),
                    ),
                    meter.steps,
                )
            )
    return rows


# --- deadlines ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DeadlineFigures:
    order: str
    requests: int
    tight: int
    missed: int
    missed_tight: int
    missed_loose: int
    expired: int


def deadlines(seed: int, duration_s: float) -> list[DeadlineFigures]:
    requests = _arrivals(
        random.Random(seed), "t", 1.1 * CAPACITY_RPS, duration_s, deadline=(1 / 3, 3.0)
    )
    edf = TODAY.model_copy(update={"deadline_order": True})
    rows = []
    for order, config in (("today (FCFS)", TODAY), ("EDF", edf)):
        result, _ = _run(config, requests)
        missed = missed_tight = expired = tight = 0
        for outcome in result.outcomes.values():
            due = outcome.request.deadline_s
            assert due is not None
            is_tight = due - outcome.request.arrival_s < 60
            tight += is_tight
            event = outcome.event
            late = event is None or event.reason is FinishReason.DEADLINE
            late = late or (outcome.finished_s is not None and outcome.finished_s > due)
            expired += event is not None and event.reason is FinishReason.DEADLINE
            missed += late
            missed_tight += late and is_tight
        rows.append(
            DeadlineFigures(
                order, len(requests), tight, missed, missed_tight, missed - missed_tight, expired
            )
        )
    return rows


def calibrate(seed: int) -> float:
    """Requests per second the executor finishes when it always has work."""
    requests = _arrivals(random.Random(seed), "t", 200.0, 5.0)
    result, _ = _run(TODAY, requests)
    return len(requests) / result.end_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("flood", "shares", "deadlines", "all"), default="all")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--calibrate", action="store_true", help="measure CAPACITY_RPS")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.calibrate:
        print(f"capacity: {calibrate(args.seed):.1f} requests/s")
        return 0
    out: dict[str, Sequence[FloodFigures | ShareFigures | DeadlineFigures]] = {}
    if args.mode in ("flood", "all"):
        out["flood"] = flood(args.seed, args.duration_s)
    if args.mode in ("shares", "all"):
        out["shares"] = shares(args.seed, args.duration_s)
    if args.mode in ("deadlines", "all"):
        out["deadlines"] = deadlines(args.seed, args.duration_s)
    if args.json:
        print(json.dumps({k: [asdict(r) for r in v] for k, v in out.items()}, indent=2))
        return 0
    print(
        f"one executor (capacity about {CAPACITY_RPS} requests/s), "
        f"{args.duration_s:.0f} s of arrivals, seed {args.seed}"
    )
    for row in out.get("flood", []):
        assert isinstance(row, FloodFigures)
        print(
            f"flood   {row.order:<6} light TTFT p50 {row.light_ttft_p50_s:.3f}s p99 "
            f"{row.light_ttft_p99_s:.3f}s | solo p50 {row.solo_ttft_p50_s:.3f}s p99 "
            f"{row.solo_ttft_p99_s:.3f}s | p99 {row.p99_vs_solo:.2f}x solo | wait before its "
            f"first step p99 {row.wait_p99_s:.3f}s, own step p99 {row.own_step_p99_s:.3f}s | "
            f"bound p99 {row.bound_p99_s:.3f}s ({row.bound_p99_s / row.solo_ttft_p99_s:.2f}x solo)"
        )
    for row in out.get("shares", []):
        assert isinstance(row, ShareFigures)
        print(
            f"shares  {row.order:<6} weights {row.weights}: light {row.light_share:.1%} "
            f"(target {row.light_target:.1%}), heavy {row.heavy_share:.1%} (target "
            f"{row.heavy_target:.1%}), worst {row.worst_off_by:.1%} off, over "
            f"{row.backlogged_steps} steps with both waiting"
        )
    for row in out.get("deadlines", []):
        assert isinstance(row, DeadlineFigures)
        print(
            f"deadlines {row.order:<13} missed {row.missed}/{row.requests} (due in 3 s: "
            f"{row.missed_tight}/{row.tight}, due in 120 s: {row.missed_loose}), expired "
            f"{row.expired}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
