"""The admission service: wiring, start-up and the ordered shutdown.

Start-up: tokenizer (if configured: a file; or the executors' own, fetched as each connects) →
topics (created or checked) → exactly-once probe → admin API (health answers from here on) →
producers, consumer group, abort reader, Kafka health checks → executors from the static
membership → ready.

Shutdown (SIGTERM):

1. stop fetching: the consumer pauses and the intake loop ends (records fetched but not queued
   are read again by the partitions' next owner);
2. running work has ``shutdown.grace_period_s`` to finish (aborts are still honoured);
3. what is left is handed off: cancelled here without an answer, so its offset stays
   uncommitted and the next owner runs it;
4. the executor sessions close (all at once); a last commit cycle per partition commits
   everything answered, up to the lowest handed-off offset; producers stop; the consumer leaves
   the group; exit 0 — or exit 1 when answers made here could not be written (logged with their
   count; the requests run again on the partitions' next owners). Steps 3–4 share
   ``shutdown.closing_timeout_s``: a step still running when it is spent is left behind, so
   the process exits within the grace period plus that budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiokafka import AIOKafkaProducer
from opentelemetry import trace

from kvgate.admission_service.admin import AdminApi
from kvgate.admission_service.dead_letters import MIN_DEAD_LETTER_BYTES
from kvgate.admission_service.engine import Engine, EngineSettings
from kvgate.admission_service.executor_client import Connector, WebSocketConnector
from kvgate.admission_service.executor_handle import SessionSettings
from kvgate.admission_service.executor_tokenizer import PoolTokenizer, TokenizerCheckingConnector
from kvgate.admission_service.faults import CrashPoints
from kvgate.admission_service.idempotency import AnsweredIds
from kvgate.admission_service.intake import AbortReader, Intake, request_consumer
from kvgate.admission_service.kafka_health import KafkaHealth
from kvgate.admission_service.kafka_io import (
    KafkaSetupError,
    TopicLimits,
    ensure_topics,
    exactly_once_enabled,
)
from kvgate.admission_service.metrics import ServiceMetrics, StateSnapshot
from kvgate.admission_service.outbox import Outbox
from kvgate.admission_service.settings import ServiceSettings
from kvgate.admission_service.tokenizer import TextCodec, load_tokenizer
from kvgate.admission_service.tracing import ServiceTracer
from kvgate.kafka_connection import SettingsError, client_options
from kvgate.protocol.admin import QueueLoad

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class AdmissionService:
    def __init__(
        self,
        settings: ServiceSettings,
        *,
        connector: Connector | None = None,
        tracer: trace.Tracer | None = None,
        timeline_steps: int = 0,
    ) -> None:
        self.settings = settings
        self.metrics = ServiceMetrics(settings.telemetry.model_name)
        self.tokenizer: TextCodec | None = None
        if settings.limits.tokenizer_file is not None:
            self.tokenizer = load_tokenizer(
                settings.limits.tokenizer_file, settings.limits.tool_call_parser
            )
        executors = settings.executors
        self._http: aiohttp.ClientSession | None = None
        if connector is None:
            token = executors.token_value()
            if token is None:
                raise SettingsError(
                    "executors.token (or executors.token_file) is required to reach executors"
                )
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=executors.connect_timeout_s)
            )
            connector = WebSocketConnector(
                self._http,
                token,
                connect_timeout_s=executors.connect_timeout_s,
                heartbeat_s=executors.heartbeat_s,
                step_timeout_s=executors.step_timeout_s,
            )
            if executors.tokenizer_from_executors:
                pool_tokenizer = PoolTokenizer(settings.limits.tool_call_parser)
                self.tokenizer = pool_tokenizer
                connector = TokenizerCheckingConnector(
                    connector,
                    pool_tokenizer,
                    self._http,
                    token,
                    timeout_s=executors.connect_timeout_s,
                )
        self.engine_settings = EngineSettings(
            scheduler=settings.scheduler,
            session=SessionSettings(
                reconnect_initial_s=executors.reconnect_initial_s,
                reconnect_max_s=executors.reconnect_max_s,
                enable_prefix_caching=executors.enable_prefix_caching,
                migrate_on_drain=executors.migrate_on_drain,
                migration_timeout_s=executors.migration_timeout_s,
                export_ttl_s=executors.migration_ttl_s,
            ),
            max_request_failures=executors.max_request_failures,
            token_stream=settings.kafka.token_topic is not None,
            abort_memory_s=settings.limits.abort_memory_s,
            timeline_steps=timeline_steps,
            placement=settings.placement,
            tenants=settings.tenants,
        )
        self._connector = connector
        self._tracer = ServiceTracer(tracer, settings.telemetry.model_name)
        self.kafka_health = KafkaHealth(settings.kafka, self.metrics)
        self.engine: Engine | None = None
        self.intake: Intake | None = None
        self.outbox: Outbox | None = None
        self._aborts: AbortReader | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._outbox_task: asyncio.Task[None] | None = None
        self.ready = False
        self.exactly_once = False
        self.admin_port: int | None = None
        self._failed: BaseException | None = None
        self.failed = asyncio.Event()
        self._topic_limits: TopicLimits | None = None

    # -------------------------------------------------------------------------- start
    async def start(self) -> None:
        kafka = self.settings.kafka
        limits = await ensure_topics(kafka)
        self._topic_limits = limits
        self.exactly_once = await exactly_once_enabled(kafka)
        log.info(
            "%s has %d partitions; exactly-once %s",
            kafka.request_topic,
            limits.request_partitions,
            "on (transactions)" if self.exactly_once else "off (at-least-once)",
        )
        consumer = request_consumer(self.settings)
        limits_settings = self.settings.limits
        answered = AnsweredIds(
            limits_settings.idempotency_window_s, limits_settings.idempotency_max_ids
        )
        self.outbox = Outbox(
            kafka,
            transactional=self.exactly_once,
            producer_factory=self._producer,
            commit_offsets=consumer.commit,
            metrics=self.metrics,
            dead_letter_max_bytes=self._dead_letter_room(limits),
            answered=answered,
            crash_points=CrashPoints(),
            on_fenced=self._fenced,
        )
        engine = Engine(
            self.engine_settings,
            answered=answered,
            connector=self._connector,
            sink=self.outbox,
            tracer=self._tracer,
            metrics=self.metrics,
            tokenizer=self.tokenizer,
        )
        self.engine = engine
        self.intake = Intake(
            self.settings,
            consumer,
            engine=engine,
            outbox=self.outbox,
            metrics=self.metrics,
            tokenizer=self.tokenizer,
            on_failure=self._fail,
        )
        self.metrics.bind_state(self._snapshot)
        await self._start_admin(engine)
        await self.outbox.start()
        await consumer.start()
        self.intake.subscribe()
        self._aborts = AbortReader(self.settings, engine)
        await self._aborts.start()
        self._spawn(self.intake.run(), "intake")
        self._outbox_task = self._spawn(self.outbox.run(), "outbox")
        self._spawn(self._aborts.run(), "aborts")
        self._spawn(self.kafka_health.run(), "kafka-health")
        await engine.set_members(self.settings.executors.members)
        self.ready = True

    @property
    def _max_request_bytes(self) -> int:
        """The producers' request limit: room for dead letters of the largest requests the
        service reads, and of the largest the request topic accepts (plus their headers)."""
        topic = self._topic_limits.request_max_bytes if self._topic_limits is not None else None
        return max(1 << 20, 4 * self.settings.limits.max_message_bytes, (topic or 0) + (64 << 10))

    def _dead_letter_room(self, limits: TopicLimits) -> int:
        """The most a dead letter may take: what the producer sends and the topic accepts."""
        room = self._max_request_bytes
        if limits.dlq_max_bytes is not None:
            room = min(room, limits.dlq_max_bytes)
        if room < MIN_DEAD_LETTER_BYTES:
            raise KafkaSetupError(
                f"topic {self.settings.kafka.dlq_topic} accepts records of only {room} bytes; "
                f"dead letters need at least {MIN_DEAD_LETTER_BYTES} (max.message.bytes)"
            )
        return room

    def _producer(self, transactional_id: str | None) -> AIOKafkaProducer:
        kafka = self.settings.kafka
        size = self._max_request_bytes
        if transactional_id is None:
            return AIOKafkaProducer(
                **client_options(kafka), acks="all", enable_idempotence=False, max_request_size=size
            )
        return AIOKafkaProducer(
            **client_options(kafka),
            transactional_id=transactional_id,
            transaction_timeout_ms=kafka.transaction_timeout_ms,
            max_request_size=size,
        )

    async def _start_admin(self, engine: Engine) -> None:
        admin = self.settings.admin
        api = AdminApi(
            engine,
            self.metrics,
            token=admin.token_value(),
            ready=lambda: self.ready,
            healthy=lambda: self._failed is None,
            outage=self._outage,
            queue=self._queue_load,
            limits=admin.http_limits,
        )
        self._runner = api.runner()
        await self._runner.setup()
        site = web.TCPSite(self._runner, admin.host, admin.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.admin_port = int(sockets[0].getsockname()[1]) if sockets else admin.port
        log.info("admin API on http://%s:%d", admin.host, self.admin_port)

    def _outage(self) -> str | None:
        """Why the service cannot do its work now (readiness): Kafka does not answer, or a
        partition's commit cycles have kept failing longer than kafka.commit_stall_timeout_s."""
        kafka = self.kafka_health.outage()
        if kafka is not None:
            return kafka
        if self.outbox is None:
            return None
        limit = self.settings.kafka.commit_stall_timeout_s
        stuck = [s for s in self.outbox.stuck() if s.stalled_s >= limit]
        if not stuck:
            return None
        return "; ".join(
            f"partition {s.partition}: commits failing for {s.stalled_s:.1f} s "
            f"({s.unwritten} answers unwritten): {s.error}"
            for s in stuck
        )

    def _fenced(self, partition: int) -> None:
        if self.intake is not None:
            self.intake.fenced(partition)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(work, name=f"kvgate-{name}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("%s failed: %r", task.get_name(), error, exc_info=error)
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if self._failed is None:
            self._failed = error
            self.ready = False
            self.failed.set()

    @property
    def failure(self) -> BaseException | None:
        return self._failed

    def _queue_load(self) -> QueueLoad:
        lag = self.intake.lag() if self.intake is not None else {}
        unplaced = self.engine.num_unplaced if self.engine is not None else 0
        return QueueLoad(consumer_lag=sum(lag.values()), unplaced=unplaced)

    def _snapshot(self) -> StateSnapshot:
        engine = self.engine
        unplaced = engine.num_unplaced if engine is not None else 0
        gauges = engine.executor_gauges() if engine is not None else []
        lag = self.intake.lag() if self.intake is not None else {}
        paused = self.intake.paused if self.intake is not None else False
        outbox = self.outbox
        unwritten = outbox.unwritten_by_partition() if outbox is not None else {}
        stalled = {s.partition: s.stalled_s for s in outbox.stuck()} if outbox is not None else {}
        tracked = engine.num_tracked if engine is not None else 0
        return StateSnapshot(
            unplaced=unplaced,
            executors=gauges,
            consumer_lag=lag,
            paused=paused,
            in_flight=tracked + sum(unwritten.values()),
            kafka_reachable=self.kafka_health.reachable,
            unwritten=unwritten,
            stalled_s=stalled,
        )

    # ------------------------------------------------------------------------ shutdown
    async def shutdown(self) -> int:
        """The ordered shutdown of the module docstring; safe after a failed start. Returns
        how many answers could not be written (0 when everything made here is durable)."""
        self.ready = False
        grace = self.settings.shutdown.grace_period_s
        if self.intake is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.intake.stop_fetching(), 10.0)
        if self.engine is not None:
            try:
                if self.engine.num_tracked:
                    await asyncio.wait_for(self.engine.wait_idle(), grace)
            except TimeoutError:
                log.warning(
                    "%d requests unfinished after %.0f s: handing them off",
                    self.engine.num_tracked,
                    grace,
                )
        # Everything from here on shares one budget, so the process exits in bounded time.
        closing = _Budget(self.settings.shutdown.closing_timeout_s)
        if self.engine is not None:
            with _timed("leaving the executors"):
                await self.engine.close(closing.left(30.0))
        if self.outbox is not None and self._outbox_task is not None:
            self.outbox.stop_soon()  # never cancelled mid-transaction
            with _timed("the outbox's last cycle"), contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._outbox_task), closing.left(60.0))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        unwritten = 0
        if self.outbox is not None:
            for partition, before in self.outbox.unwritten_by_partition().items():
                left = await _closing(
                    f"partition {partition}", self.outbox.close_partition(partition), closing
                )
                unwritten += before if left is None else left
        if self._aborts is not None:
            await _closing("the abort reader", self._aborts.stop(), closing)
        if self.intake is not None:
            await _closing("the consumer", self.intake.consumer.stop(), closing)
        if self.outbox is not None:
            await _closing("the producers", self.outbox.close(), closing)
        if self._http is not None:
            await self._http.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if unwritten:
            log.error(
                "shutting down with %d answers never written: their requests run again on the "
                "partitions' next owners",
                unwritten,
            )
        return unwritten


@contextlib.contextmanager
def _timed(what: str) -> Iterator[None]:
    """Log a shutdown step that took more than a second, so a slow shutdown says where."""
    began = time.monotonic()
    try:
        yield
    finally:
        took = time.monotonic() - began
        if took > 1.0:
            log.info("shutdown: %s took %.1f s", what, took)


class _Budget:
    """Seconds left of the shutdown's closing budget."""

    def __init__(self, seconds: float) -> None:
        self._until = time.monotonic() + seconds

    def left(self, at_most: float) -> float:
        """What one step may take: the rest of the budget, at most ``at_most``, never below a
        moment (a spent budget still lets a step that is already done report it)."""
        return max(min(at_most, self._until - time.monotonic()), 0.01)


async def _closing(what: str, closing: Coroutine[Any, Any, _T], budget: _Budget) -> _T | None:
    """One shutdown step, its result (None when it failed: that is logged and the next step
    still runs).

    aiokafka can let a ``CancelledError`` of its own internal tasks escape from ``stop()``;
    that one is swallowed here, while a cancellation of the shutdown itself propagates.
    """
    task = asyncio.ensure_future(closing)
    try:
        with _timed(f"closing {what}"):
            return await asyncio.wait_for(asyncio.shield(task), budget.left(30.0))
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
        log.warning("closing %s: an internal task was cancelled", what)
    except TimeoutError:
        log.warning("closing %s: not done within the closing budget; left behind", what)
    except Exception as exc:
        log.warning("closing %s failed: %r", what, exc)
    return None


def tune_garbage_collector() -> None:
    """For entry points, once start-up is done: a service that holds tens of thousands of
    queued requests spends most of its intake time in full collections of that long-lived heap
    (measured: 1.6-1.8x fewer requests/s). Start-up objects move to the permanent generation,
    and young collections run every 50,000 allocations instead of 700."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


async def serve(settings: ServiceSettings, stop: asyncio.Event, **options: Any) -> int:
    """Run until ``stop`` is set (or a loop fails); returns the exit code: 1 when a loop failed
    or answers made here were never written (their requests run again elsewhere), else 0."""
    service = AdmissionService(settings, **options)
    code = 0
    try:
        starting = asyncio.create_task(service.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return 0
        starting.result()
        tune_garbage_collector()
        failing = asyncio.create_task(service.failed.wait())
        await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failing.cancel()
        code = 1 if service.failure is not None else 0
    finally:
        unwritten = await service.shutdown()
    return 1 if unwritten else code
