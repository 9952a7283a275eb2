"""Per-tenant quotas in tokens per minute, enforced where every request of the pool passes: the
admission service (pure: time is passed in). The settings (``TenantsSettings``) are the
protocol's, shared with the ExecutorPool's ``spec.tenants``.

A tenant's quota is a token bucket: it holds up to ``burst_tokens`` (default: one minute's worth)
and refills at ``tokens_per_minute / 60`` per second. A request is charged when it is read: its
prompt tokens and ``max_tokens`` per choice, the most it can cost. If the bucket does not hold
that much it is rejected (``quota_exceeded``, with the wait until it would fit); when a choice
finishes, the output tokens it did not generate are credited back. A request that leaves without
finishing (aborted, failed, handed off) keeps its charge.

Because the gateways only forward, a limit means the same with one gateway replica or five. The
counter is this service instance's: with several admission-service replicas each one enforces
the quota on the request partitions it owns (per shard) — divide the quota by the replica count
when requests spread evenly over partitions, as the gateway divides its per-key rate limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.protocol.tenants import DEFAULT_TENANT, TenantQuota, TenantsSettings


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at_s: float


class Quotas:
    """Token buckets by tenant (see the module docstring)."""

    def __init__(self, settings: TenantsSettings) -> None:
        self._settings = settings
        self._buckets: dict[str, _Bucket] = {}

    def quota(self, tenant: str | None) -> TenantQuota | None:
        return self._settings.quotas.get(tenant or DEFAULT_TENANT, self._settings.default_quota)

    def take(self, tenant: str | None, tokens: int, now_s: float) -> float | None:
        """Charge ``tokens`` to ``tenant``: ``None`` when granted, else the seconds until the
        bucket would hold them (nothing is charged). A request larger than the whole bucket
        waits for a full bucket: it is granted then and leaves the bucket in debt."""
        quota = self.quota(tenant)
        if quota is None:
            return None
        bucket = self._refilled(tenant or DEFAULT_TENANT, quota, now_s)
        need = min(tokens, quota.capacity)
        if bucket.tokens >= need:
            bucket.tokens -= tokens
            return None
        return (need - bucket.tokens) * 60.0 / quota.tokens_per_minute

    def credit(self, tenant: str | None, tokens: int, now_s: float) -> None:
        """Give back ``tokens`` charged and not used."""
        quota = self.quota(tenant)
        if quota is None or tokens <= 0:
            return
        bucket = self._refilled(tenant or DEFAULT_TENANT, quota, now_s)
        bucket.tokens = min(float(quota.capacity), bucket.tokens + tokens)

    def available(self, tenant: str | None, now_s: float) -> float | None:
        quota = self.quota(tenant)
        if quota is None:
            return None
        return self._refilled(tenant or DEFAULT_TENANT, quota, now_s).tokens

    def _refilled(self, tenant: str, quota: TenantQuota, now_s: float) -> _Bucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(quota.capacity), now_s)
        elapsed = max(0.0, now_s - bucket.at_s)
        rate = quota.tokens_per_minute / 60.0
        bucket.tokens = min(float(quota.capacity), bucket.tokens + elapsed * rate)
        bucket.at_s = now_s
        return bucket
