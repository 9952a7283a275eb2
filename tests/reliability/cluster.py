"""One scenario's stack: fresh topics on the session's broker, and every process it starts
(admission services, real or simulated executors), stopped at the end of the test.

It also holds the checks every scenario ends with: exactly one outcome per produced record
(``traffic.check_outcomes``) and nothing left behind — no request, KV block or host snapshot
held by the admission service or reported by an executor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.protocol.records import DeadLetter, InferenceResult
from tests.admission_service.kafka_helpers import Topics
from tests.harness.kafka import KafkaBroker
from tests.integration.admission_stack import (
    Process,
    Service,
    SimExecutor,
    service_settings,
    start_service,
    start_sim_executor,
)
from tests.reliability.processes import (
    RealExecutor,
    metric_sum,
    parse_metrics,
    poll,
    restart_real_executor,
    scrape,
    spawn_real_executor,
    wait_executor_ready,
)
from tests.reliability.traffic import (
    Message,
    Sent,
    Summary,
    check_outcomes,
    expected_letters,
    expected_results,
    read_answers,
    read_letters,
    send,
)
from tests.reliability.workloads import Output

Executor = SimExecutor | RealExecutor

# What an idle admission service must report as zero (summed over executors).
_SERVICE_IDLE = (
    "kvgate_admission_requests_in_flight",
    "kvgate_admission_queue_depth",
    "kvgate_admission_running_requests",
    "kvgate_admission_kv_blocks_used",
    "kvgate_admission_host_snapshot_blocks_used",
    "kvgate_admission_executor_held_requests",
    "kvgate_admission_executor_held_snapshots",
    "kvgate_admission_executor_held_host_blocks",
)
# What an idle ``kvgate executor`` must report as zero on its own /metrics.
_EXECUTOR_IDLE = (
    "kvgate_executor_requests",
    "kvgate_executor_snapshots",
    "kvgate_executor_host_blocks_used",
)


@dataclass
class Cluster:
    broker: KafkaBroker
    log_dir: Path
    topics: Topics
    services: list[Process] = field(default_factory=list)
    executors: list[Process] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)

    @property
    def processes(self) -> list[Process]:
        return [*self.services, *self.executors]

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap

    # ------------------------------------------------------------------------ processes
    def sim_executors(self, *names: str, **options: Any) -> list[SimExecutor]:
        executors = [start_sim_executor(self.log_dir, name, **options) for name in names]
        self.executors += [e.process for e in executors]
        return executors

    def real_executors(self, *names: str, model_dir: Path, **options: Any) -> list[RealExecutor]:
        """Start them all, then wait for each (they load in parallel)."""
        executors = [
            spawn_real_executor(self.log_dir, name, model_dir, **options) for name in names
        ]
        self.executors += [e.process for e in executors]
        for executor in executors:
            wait_executor_ready(executor)
        return executors

    def restart_executor(self, executor: RealExecutor) -> RealExecutor:
        restarted = restart_real_executor(self.log_dir, executor)
        self.executors.append(restarted.process)
        return restarted

    def settings(self, executors: Sequence[Executor], **sections: Any) -> dict[str, Any]:
        kafka = {"health_check_interval_s": 0.5, "health_check_timeout_s": 2.0}
        sections["kafka"] = kafka | sections.get("kafka", {})
        return service_settings(self.bootstrap, self.topics, list(executors), **sections)  # type: ignore[arg-type]

    def service(
        self,
        name: str,
        settings: dict[str, Any],
        *,
        env: dict[str, str] | None = None,
        wait_ready: bool = True,
    ) -> Service:
        service = start_service(self.log_dir, name, settings, env=env, wait_ready=wait_ready)
        self.services.append(service.process)
        return service

    def stop_all(self) -> None:
        """Services first (their last commits), then executors."""
        for process in self.processes:
            process.stop()

    # -------------------------------------------------------------------------- traffic
    async def send(
        self, messages: Sequence[Message], *, max_request_size: int = 1 << 21
    ) -> list[Sent]:
        sent = await send(
            self.bootstrap, self.topics.requests, messages, max_request_size=max_request_size
        )
        self.sent += sent
        return sent

    async def send_requests(self, bodies: Sequence[dict[str, Any]]) -> list[Sent]:
        return await self.send([Message.request(body) for body in bodies])

    async def answers(
        self, *, timeout_s: float = 180.0, settle_s: float = 1.0
    ) -> tuple[list[InferenceResult], list[tuple[Any, DeadLetter]]]:
        """Every result and dead letter the records sent so far must produce (read_committed),
        read a little longer (``settle_s``) to catch any that would come twice."""
        results = await read_answers(
            self.bootstrap,
            self.topics.results,
            expected_results(self.sent),
            timeout_s=timeout_s,
            settle_s=settle_s,
        )
        letters = await read_letters(
            self.bootstrap,
            self.topics.dlq,
            expected_letters(self.sent),
            timeout_s=timeout_s,
            settle_s=settle_s,
        )
        return results, letters

    async def verify(
        self,
        reference: dict[str, Output],
        services: Sequence[Service],
        executors: Sequence[Executor] = (),
        *,
        timeout_s: float = 180.0,
    ) -> Summary:
        """The end of every scenario: exactly the expected outcome for every record sent, then
        nothing held anywhere (``services`` are the ones still running)."""
        results, letters = await self.answers(timeout_s=timeout_s)
        summary = check_outcomes(self.topics.requests, self.sent, results, letters, reference)
        for service in services:
            await asyncio.to_thread(assert_idle, service, executors)
        return summary


def assert_idle(
    service: Service, executors: Sequence[Executor] = (), timeout_s: float = 30
) -> None:
    """Poll until ``service`` holds nothing and every real executor reports holding nothing
    (the plan that frees the last requests may still be on its way)."""
    busy: dict[str, float] = {}

    def idle() -> bool:
        busy.clear()
        samples = parse_metrics(service.metrics())
        for name in _SERVICE_IDLE:
            if metric_sum(samples, name) != 0:
                busy[name] = metric_sum(samples, name)
        for executor in executors:
            if isinstance(executor, RealExecutor):
                own = scrape(f"http://127.0.0.1:{executor.port}/metrics")
                for name in _EXECUTOR_IDLE:
                    if metric_sum(own, name) != 0:
                        busy[f"{executor.name}: {name}"] = metric_sum(own, name)
        return not busy

    try:
        poll(idle, "the stack to hold nothing", timeout_s)
    except AssertionError:
        raise AssertionError(f"left behind after the workload: {busy}") from None


def owned_partitions(service: Service) -> set[int]:
    """Request partitions ``service`` has read from (its consumer-lag gauge's labels)."""
    samples = parse_metrics(service.metrics())
    prefix = 'kvgate_admission_consumer_lag{partition="'
    return {int(head[len(prefix) :].split('"')[0]) for head in samples if head.startswith(prefix)}


def logged(service: Service, text: str) -> bool:
    return text in service.process.log_tail(1_000_000)
