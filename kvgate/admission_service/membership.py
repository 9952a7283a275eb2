"""The executor membership: which executors the service uses, their draining flags, and the
order in which placement considers them.

The engine owns the requests; this owns the :class:`ExecutorHandle` objects. Membership
changes are serialised (one ``set`` at a time): leaving executors are removed from the set
*before* they stop, so the requests they hand back are never placed on them again.
"""

from __future__ import annotations

import asyncio
import logging

from kvgate.admission_service.executor_client import Connector, EpochClock
from kvgate.admission_service.executor_handle import ExecutorHandle, PoolObserver, SessionSettings
from kvgate.admission_service.metrics import ExecutorGauge
from kvgate.protocol.admin import ExecutorSpec, ExecutorState, ExecutorStatus
from kvgate.scheduler.config import SchedulerConfig

log = logging.getLogger(__name__)


class Membership:
    def __init__(
        self,
        *,
        connector: Connector,
        epochs: EpochClock,
        scheduler: SchedulerConfig,
        session: SessionSettings,
        observer: PoolObserver,
    ) -> None:
        self._connector = connector
        self._epochs = epochs
        self._scheduler = scheduler
        self._session = session
        self._observer = observer
        self.handles: dict[str, ExecutorHandle] = {}
        self._lock = asyncio.Lock()

    # ---------------------------------------------------------------------------- views
    def ready(self) -> list[ExecutorHandle]:
        """Executors that take new requests, most free KV capacity first (then by name)."""
        ready = [h for h in self.handles.values() if h.accepts_work]
        return sorted(ready, key=lambda h: (-h.headroom_blocks, h.name))

    @property
    def num_waiting(self) -> int:
        return sum(h.scheduler.num_waiting for h in self.handles.values() if h.scheduler)

    @property
    def num_running(self) -> int:
        return sum(h.scheduler.num_running for h in self.handles.values() if h.scheduler)

    def gauges(self) -> list[ExecutorGauge]:
        gauges = []
        for handle in self.handles.values():
            s = handle.status()
            gauges.append(
                ExecutorGauge(
                    s.name, s.state.value, s.waiting_requests, s.running_requests,
                    s.kv_blocks_used, s.kv_blocks_total,
                    host_blocks_used=handle.host_blocks_used, reported=handle.reported,
                )
            )  # fmt: skip
        return gauges

    # -------------------------------------------------------------------------- changes
    async def set(self, specs: list[ExecutorSpec]) -> None:
        """Make the executor set exactly ``specs``: new ones connect, missing ones (or ones
        with a new endpoint) leave and hand their requests back, draining flags are applied."""
        async with self._lock:
            wanted = {spec.name: spec for spec in specs}
            leaving = [
                handle
                for name, handle in self.handles.items()
                if name not in wanted or wanted[name].endpoint != handle.spec.endpoint
            ]
            for handle in leaving:
                del self.handles[handle.name]
            for handle in leaving:
                log.info("executor %s leaves the membership", handle.name)
                await handle.stop()
            for name, spec in wanted.items():
                current = self.handles.get(name)
                if current is None:
                    handle = ExecutorHandle(
                        spec,
                        connector=self._connector,
                        epochs=self._epochs,
                        scheduler_config=self._scheduler,
                        settings=self._session,
                        observer=self._observer,
                    )
                    self.handles[name] = handle
                    handle.start()
                elif current.draining != spec.draining:
                    current.set_draining(spec.draining)
            self.evacuate_drains()

    def drain(self, name: str) -> ExecutorStatus | None:
        handle = self.handles.get(name)
        if handle is None:
            return None
        handle.set_draining(True)
        self.evacuate_drains()
        return handle.status()

    def evacuate_drains(self) -> None:
        """Draining executors hand their requests to the ready ones — when there are any;
        with nowhere to go, their requests finish where they are."""
        if not any(h.accepts_work for h in self.handles.values()):
            return
        for handle in self.handles.values():
            if handle.state is ExecutorState.DRAINING:
                handle.request_evacuation()

    async def close(self) -> None:
        """Every executor leaves (their requests are handed back to the observer)."""
        async with self._lock:
            handles = list(self.handles.values())
            self.handles.clear()
            await asyncio.gather(*(handle.stop() for handle in handles))
