"""Cache-aware placement against today's and other rules, on multi-turn chat over 8 executors.

    PYTHONPATH=. python benchmarks/bench_placement.py [--sessions N] [--seed S] [--json]

Sessions (a conversation each) start over a window and alternate user turns and assistant
replies: turn k's prompt is one of four shared system prompts, the whole history (the earlier
user turns and the replies the executors actually produced) and the new user turn; the next turn
arrives a think time after the reply. Eight simulated executors (``kvgate.sim.cluster``: the
service's placement and re-placement, each executor's scheduler, a step cost proportional to the
work: ``StepCost``) serve them, under each rule in the same run:

- ``cache-aware``: the service's placement (``admission_service/placement.py``), pulls included;
- ``today``: most KV headroom first (the rule before it, ``policy: headroom``);
- ``round-robin``;
- ``approximate``: the same scoring over block digests seen with a lag (``--lag-s``), as a
  router fed by KV-cache events sees them, without re-placement.

Reported: prefill tokens computed, prefix-cache hit rate (cached / looked-up prompt tokens), time
to first token p50/p99, and the most and least loaded executor's share of the work (prefill
token passes + decode rows; 1/8 is even).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.admission_service.placement import (
    Ask,
    ExecutorView,
    PlacementPolicy,
    PlacementSettings,
    Placer,
)
from kvgate.scheduler.config import SchedulerConfig
from kvgate.scheduler.events import FinishedEvent
from kvgate.sim.cluster import (
    Cluster,
    ClusterRequest,
    ClusterResult,
    Node,
    build_node,
)
from kvgate.sim.counting_executor import CountingExecutor

VOCAB = 32_000
NUM_EXECUTORS = 8
BLOCK_SIZE = 16
NUM_BLOCKS = 4096  # 65,536 tokens of KV per executor
SCHEDULER = SchedulerConfig(
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    prefill_chunk_size=512,
    async_scheduling=False,
)


@dataclass(frozen=True, slots=True)
class ChatShape:
    sessions: int = 256
    window_s: float = 40.0  # sessions start uniformly over this window
    system_prompts: int = 4
    system_tokens: int = 800
    turns: tuple[int, int] = (3, 8)
    user_tokens: tuple[int, int] = (40, 200)
    reply_tokens: tuple[int, int] = (30, 150)
    think_s: float = 1.5  # mean think time between a reply and the next turn


@dataclass(slots=True)
class _Session:
    index: int
    system: tuple[int, ...]
    turns_left: int
    history: list[int] = field(default_factory=list)
    turn: int = 0


class Chat:
    """The closed-loop multi-turn workload: the next turn follows each reply."""

    def __init__(self, shape: ChatShape, seed: int) -> None:
        self.shape = shape
        self._rng = random.Random(seed)
        rng = self._rng
        systems = [
            tuple(rng.randrange(VOCAB) for _ in range(shape.system_tokens))
            for _ in range(shape.system_prompts)
        ]
        self._sessions: dict[str, _Session] = {}
        self.first: list[ClusterRequest] = []
        for index in range(shape.sessions):
            session = _Session(index, systems[index % len(systems)], rng.randint(*shape.turns))
            start_s = rng.uniform(0.0, shape.window_s)
            self.first.append(self._turn(session, start_s))

    def _turn(self, session: _Session, at_s: float) -> ClusterRequest:
        rng = self._rng
        user = [rng.randrange(VOCAB) for _ in range(rng.randint(*self.shape.user_tokens))]
        session.history.extend(user)
        rid = f"s{session.index}-t{session.turn}"
        session.turn += 1
        session.turns_left -= 1
        self._sessions[rid] = session
        return ClusterRequest(
            request_id=rid,
            prompt_token_ids=(*session.system, *session.history),
            max_tokens=rng.randint(*self.shape.reply_tokens),
            arrival_s=at_s,
            affinity_key=f"session-{session.index}",
            seed=session.index,
        )

    def follow_up(
        self, request: ClusterRequest, event: FinishedEvent, now: float
    ) -> Iterable[ClusterRequest]:
        session = self._sessions.pop(request.request_id)
        session.history.extend(event.output_token_ids)
        if session.turns_left <= 0:
            return []
        return [self._turn(session, now + self._rng.expovariate(1.0 / self.shape.think_s))]


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def rank(self, ask: Ask, executors: Sequence[Node]) -> Sequence[ExecutorView]:
        first = self._next % len(executors)
        self._next += 1
        return [*executors[first:], *executors[:first]]


class _Lagged:
    """A node as a router fed by KV-cache events sees it: digests as of the last refresh."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.digests: frozenset[bytes] = frozenset()

    def refresh(self) -> None:
        self.digests = self.node.scheduler.state.pool.cached_digests()

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def block_size(self) -> int:
        return self.node.block_size

    @property
    def outstanding(self) -> int:
        return self.node.outstanding

    @property
    def backlog_tokens(self) -> int:
        return self.node.backlog_tokens

    @property
    def headroom_blocks(self) -> int:
        return self.node.headroom_blocks

    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int:
        count = 0
        for digest in digests:
            if digest not in self.digests:
                break
            count += 1
        return count

    def has_room_for(self, prompt_len: int, max_tokens: int) -> bool:
        return self.node.has_room_for(prompt_len, max_tokens)


class LaggedScorer:
    """The cache-aware scoring over digests that arrive ``lag_s`` late; no re-placement."""

    def __init__(self, nodes: list[Node], lag_s: float) -> None:
        self._placer = Placer(PlacementSettings())
        self._views = [_Lagged(node) for node in nodes]
        self._lag_s = lag_s
        self._refreshed_at = 0.0

    def tick(self, now: float, nodes: list[Node]) -> None:
        if now - self._refreshed_at >= self._lag_s:
            self._refreshed_at = now
            for view in self._views:
                view.refresh()

    def rank(self, ask: Ask, executors: Sequence[Node]) -> Sequence[ExecutorView]:
        ranked = self._placer.rank(ask, self._views)
        self._placer.placed(ask, ranked[0])
        return ranked


@dataclass(frozen=True, slots=True)
class Figures:
    rule: str
    requests: int
    finished: int
    prefill_tokens: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    most_loaded_share: float
    least_loaded_share: float
    moves: int
    end_s: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def figures(rule: str, result: ClusterResult) -> Figures:
    nodes = result.nodes
    work = [node.prefill_tokens + node.decode_rows for node in nodes]
    total = sum(work) or 1
    queried = sum(node.prefix_queried_tokens for node in nodes)
    hits = sum(node.prefix_hit_tokens for node in nodes)
    ttfts = [o.ttft_s for o in result.outcomes.values() if o.ttft_s is not None]
    return Figures(
        rule=rule,
        requests=len(result.outcomes),
        finished=sum(1 for o in result.outcomes.values() if o.event is not None),
        prefill_tokens=sum(node.prefill_tokens for node in nodes),
        hit_rate=hits / queried if queried else 0.0,
        ttft_p50_s=_percentile(ttfts, 0.50),
        ttft_p99_s=_percentile(ttfts, 0.99),
        most_loaded_share=max(work) / total,
        least_loaded_share=min(work) / total,
        moves=result.moves,
        end_s=result.end_s,
    )


def _nodes() -> list[Node]:
    return [
        build_node(
            f"e{i}",
            SCHEDULER,
            CountingExecutor(name=f"e{i}", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
        )
        for i in range(NUM_EXECUTORS)
    ]


def run_rule(rule: str, shape: ChatShape, seed: int, lag_s: float) -> Figures:
    nodes = _nodes()
    chat = Chat(shape, seed)
    if rule == "cache-aware":
        cluster = Cluster(nodes, Placer(PlacementSettings()))
    elif rule == "today":
        cluster = Cluster(nodes, Placer(PlacementSettings(policy=PlacementPolicy.HEADROOM)))
    elif rule == "round-robin":
        cluster = Cluster(nodes, RoundRobin())
    elif rule == "approximate":
        scorer = LaggedScorer(nodes, lag_s)
        cluster = Cluster(nodes, scorer, on_step=scorer.tick)
    else:
        raise ValueError(rule)
    for request in chat.first:
        cluster.submit(request)
    return figures(rule, cluster.run(chat.follow_up))


RULES = ("today", "cache-aware", "round-robin", "approximate")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=ChatShape().sessions)
    parser.add_argument("--window-s", type=float, default=ChatShape().window_s)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lag-s", type=float, default=1.0, help="the approximate scorer's lag")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shape = ChatShape(sessions=args.sessions, window_s=args.window_s)
    rows = [run_rule(rule, shape, args.seed, args.lag_s) for rule in RULES]
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return 0
    today = rows[0]
    print(
        f"multi-turn chat: {shape.sessions} sessions over {shape.window_s:.0f} s, "
        f"{NUM_EXECUTORS} executors, seed {args.seed}"
    )
    print(
        f"{'rule':<12} {'requests':>8} {'prefill tok':>12} {'vs today':>8} {'hit rate':>8} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'max share':>9} {'min share':>9} {'moves':>6}"
    )
    for row in rows:
        print(
            f"{row.rule:<12} {row.finished:>4}/{row.requests:<3} {row.prefill_tokens:>12,} "
            f"{row.prefill_tokens / today.prefill_tokens:>8.2f} {row.hit_rate:>8.1%} "
            f"{row.ttft_p50_s:>8.3f}s {row.ttft_p99_s:>8.3f}s {row.most_loaded_share:>9.1%} "
            f"{row.least_loaded_share:>9.1%} {row.moves:>6}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
