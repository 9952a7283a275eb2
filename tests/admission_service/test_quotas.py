"""Per-tenant quotas: a token bucket per tenant, refilled at tokens_per_minute / 60 per second,
charged the most a request can cost when it is read, refused (with the wait) without a charge,
credited back for output not generated. Times are passed in: no clock, no sleeping."""

from __future__ import annotations

import pytest

from kvgate.admission_service.quotas import Quotas
from kvgate.protocol.tenants import TenantQuota, TenantsSettings

PER_MINUTE = 600  # 10 tokens per second


def _quotas(**extra: object) -> Quotas:
    return Quotas(
        TenantsSettings.model_validate(
            {"quotas": {"a": {"tokens_per_minute": PER_MINUTE}}, **extra}
        )
    )


def test_a_request_past_the_bucket_is_refused_with_the_wait_and_is_not_charged() -> None:
    quotas = _quotas()
    assert quotas.take("a", 550, now_s=0.0) is None
    assert quotas.available("a", now_s=0.0) == 50
    wait_s = quotas.take("a", 100, now_s=0.0)
    assert wait_s == pytest.approx(5.0)  # 50 tokens short at 10 per second
    assert quotas.available("a", now_s=0.0) == 50  # the refusal charged nothing
    assert quotas.take("a", 100, now_s=wait_s) is None  # granted once the wait is over
    assert quotas.available("a", now_s=wait_s) == pytest.approx(0.0)


def test_the_bucket_refills_up_to_its_burst_and_no_further() -> None:
    quotas = _quotas()
    assert quotas.take("a", PER_MINUTE, now_s=0.0) is None
    assert quotas.available("a", now_s=30.0) == pytest.approx(300)
    assert quotas.available("a", now_s=3600.0) == PER_MINUTE


def test_output_not_generated_is_credited_back_up_to_the_burst() -> None:
    quotas = _quotas()
    assert quotas.take("a", 500, now_s=0.0) is None  # prompt + max_tokens
    quotas.credit("a", 300, now_s=0.0)  # it stopped 300 tokens early
    assert quotas.available("a", now_s=0.0) == 400
    quotas.credit("a", 10_000, now_s=0.0)
    assert quotas.available("a", now_s=0.0) == PER_MINUTE


def test_a_request_larger_than_the_bucket_waits_for_a_full_one_and_leaves_it_in_debt() -> None:
    quotas = _quotas()
    assert quotas.take("a", 100, now_s=0.0) is None
    wait_s = quotas.take("a", 2 * PER_MINUTE, now_s=0.0)
    assert wait_s == pytest.approx(10.0)  # until the bucket is full again
    assert quotas.take("a", 2 * PER_MINUTE, now_s=10.0) is None
    available = quotas.available("a", now_s=10.0)
    assert available is not None and available == pytest.approx(-PER_MINUTE)


def test_tenants_have_buckets_of_their_own_and_the_default_quota_covers_the_unlisted() -> None:
    unlimited = _quotas()
    assert unlimited.take("a", PER_MINUTE, now_s=0.0) is None
    assert unlimited.take("b", 10**9, now_s=0.0) is None  # no quota, no default: no limit
    assert unlimited.take(None, 10**9, now_s=0.0) is None
    assert unlimited.available("b", now_s=0.0) is None
    limited = _quotas(default_quota={"tokens_per_minute": 60, "burst_tokens": 120})
    assert limited.quota("b") == TenantQuota(tokens_per_minute=60, burst_tokens=120)
    assert limited.take("b", 120, now_s=0.0) is None
    assert limited.take("c", 120, now_s=0.0) is None  # c's bucket is not b's
    assert limited.take(None, 120, now_s=0.0) is None  # the default tenant's own
    assert limited.take("b", 1, now_s=0.0) == pytest.approx(1.0)
    assert limited.take("a", PER_MINUTE, now_s=0.0) is None  # a's own quota, not the default
