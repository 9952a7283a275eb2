"""API keys (constant-time comparison) and a token-bucket rate limit per key, per replica."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.gateway.settings import ApiKey

ANONYMOUS = ApiKey(name="anonymous", key="-" * 16, min_priority=0)


def _digest(secret: str) -> bytes:
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 that way; encoding them
    # back must not fail (a 500) but give a digest that matches no key (a 401).
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """Every stored key is compared (``hmac.compare_digest`` of SHA-256 digests, so lengths
    leak nothing either) and the loop never stops early: the time taken does not depend on
    which key matched, or how much of a wrong key was right."""

    def __init__(self, keys: list[ApiKey], *, allow_anonymous: bool) -> None:
        self._keys = [(_digest(k.secret()), k) for k in keys]
        self.allow_anonymous = allow_anonymous

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        if authorization is None or not authorization.startswith("Bearer "):
            return ANONYMOUS if self.allow_anonymous else None
        offered = _digest(authorization.removeprefix("Bearer ").strip())
        found: ApiKey | None = None
        for digest, key in self._keys:
            if hmac.compare_digest(digest, offered):
                found = key
        if found is None and self.allow_anonymous and not self._keys:
            return ANONYMOUS
        return found


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """``requests_per_s`` refills a bucket of ``burst``; a request takes one token. ``take``
    returns None when allowed, else the seconds until a token is there (``Retry-After``).

    The buckets live in this replica's memory. With ``replicas`` n, this replica enforces 1/n of
    each key's rate and burst (a burst never below one request, or no request would pass), so n
    replicas together allow at most the configured rate; fewer running replicas allow less.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, replicas: int = 1) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        self._clock = clock
        self._replicas = replicas
        self._buckets: dict[str, _Bucket] = {}

    def share(self, key: ApiKey) -> tuple[float, float] | None:
        """(requests per second, burst) this replica allows ``key``; None: no limit."""
        if key.requests_per_s is None:
            return None
        burst = key.burst if key.burst is not None else max(1.0, key.requests_per_s)
        return key.requests_per_s / self._replicas, max(1.0, burst / self._replicas)

    def describe(self, keys: list[ApiKey]) -> str | None:
        """What this replica allows each rate-limited key, in one line (None: no limits)."""
        shares = [(k.name, share) for k in keys if (share := self.share(k)) is not None]
        if not shares:
            return None
        allowed = ", ".join(f"{name} {rate:g}/s burst {burst:g}" for name, (rate, burst) in shares)
        return (
            f"API key rate limits are counted per replica, in memory: this replica allows 1/"
            f"{self._replicas} of each key's rate (--rate-limit-replicas {self._replicas}): "
            f"{allowed}"
        )

    def take(self, key: ApiKey) -> float | None:
        limit = self.share(key)
        if limit is None:
            return None
        rate, burst = limit
        now = self._clock()
        bucket = self._buckets.setdefault(key.name, _Bucket(burst, now))
        bucket.tokens = min(burst, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return (1.0 - bucket.tokens) / rate
