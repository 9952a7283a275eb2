"""API keys (constant-time comparison) and a token-bucket rate limit per key."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.gateway.settings import ApiKey

ANONYMOUS = ApiKey(name="anonymous", key="-" * 16, min_priority=0)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


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
    returns None when allowed, else the seconds until a token is there (``Retry-After``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key: ApiKey) -> float | None:
        rate = key.requests_per_s
        if rate is None:
            return None
        burst = key.burst if key.burst is not None else max(1.0, rate)
        now = self._clock()
        bucket = self._buckets.setdefault(key.name, _Bucket(burst, now))
        bucket.tokens = min(burst, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return (1.0 - bucket.tokens) / rate
