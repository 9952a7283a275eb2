"""A scheduler wired to the simulated executor, driven step by step."""

from __future__ import annotations

from kvgate.protocol.step import LoopParams, SamplingParams, StepPlan
from kvgate.scheduler.config import CacheConfig, ModelShape, SchedulerConfig
from kvgate.scheduler.events import FinishedEvent, RequestEvent
from kvgate.scheduler.request import RequestSpec
from kvgate.scheduler.scheduler import Scheduler
from kvgate.scheduler.strategy import Strategy
from kvgate.sim.executor import SimExecutor
from kvgate.sim.workload import ModelSection


class Rig:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 2,
        loops: int = 1,
        host_snapshot_blocks: int = 0,
        strategy: Strategy | None = None,
        **config: object,
    ) -> None:
        self.scheduler = Scheduler(
            SchedulerConfig.model_validate(config),
            CacheConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                host_snapshot_blocks=host_snapshot_blocks,
            ),
            ModelShape(num_loops=loops),
            strategy,
        )
        self.executor = SimExecutor(
            ModelSection(loops=loops, vocab_size=97),
            num_blocks=num_blocks,
            block_size=block_size,
            host_snapshot_blocks=host_snapshot_blocks,
        )
        self.finished: dict[str, FinishedEvent] = {}
        self.plans: list[StepPlan] = []
        self.clock = 0.0

    def add(
        self, request_id: str, prompt_len: int, max_tokens: int, priority: int = 0, **kw: object
    ) -> None:
        self.scheduler.add_request(spec(request_id, prompt_len, max_tokens, priority, **kw))

    def step(self) -> StepPlan | None:
        self.clock += 1
        plan = self.scheduler.schedule(self.clock)
        self.scheduler.check_invariants()
        if plan is not None:
            self.plans.append(plan)
            self._record(self.scheduler.apply(self.executor.execute(plan)))
            self.scheduler.check_invariants()
        return plan

    def drain(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work:
                return
            self.step()
        raise AssertionError(f"did not drain in {max_steps} steps")

    def _record(self, events: list[RequestEvent]) -> None:
        for event in events:
            if isinstance(event, FinishedEvent):
                self.finished[event.request_id] = event


def spec(
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    priority: int = 0,
    *,
    seed: int = 0,
    prompt: tuple[int, ...] | None = None,
    deadline_s: float | None = None,
    trace: list[int] | None = None,
    tenant: str | None = None,
) -> RequestSpec:
    tokens = (
        prompt
        if prompt is not None
        else tuple((7 * i + len(request_id)) % 97 for i in range(prompt_len))
    )
    return RequestSpec(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling=SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True),
        loops=LoopParams(exit_trace=trace),
        priority=priority,
        deadline_s=deadline_s,
        tenant=tenant,
    )
