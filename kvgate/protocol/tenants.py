"""Tenant names, shared by the request record, the gateway's keys, the scheduler's weights and the
service's quotas (one rule for what a tenant name is), and the quota settings, shared by the
admission service's ``tenants`` section and the ExecutorPool's ``spec.tenants`` (the service
enforces them: ``admission_service/quotas.py``)."""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

TENANT_PATTERN: Final = r"^[A-Za-z0-9._-]{1,64}$"
TenantName = Annotated[str, Field(min_length=1, max_length=64, pattern=TENANT_PATTERN)]

DEFAULT_TENANT: Final = "default"
"""The tenant of a request that names none."""


# Both spellings are read: the service's config file writes snake_case, the ExecutorPool spec
# camelCase (the operator parses by alias only and writes the service's file by name).
_SETTINGS = ConfigDict(
    frozen=True,
    extra="forbid",
    alias_generator=to_camel,
    validate_by_alias=True,
    validate_by_name=True,
)


class TenantQuota(BaseModel):
    """A token bucket: it holds up to ``burst_tokens`` and refills at ``tokens_per_minute``."""

    model_config = _SETTINGS

    tokens_per_minute: Annotated[int, Field(ge=1)]
    burst_tokens: Annotated[int, Field(ge=1)] | None = None  # None: tokens_per_minute

    @property
    def capacity(self) -> int:
        return self.burst_tokens if self.burst_tokens is not None else self.tokens_per_minute


class TenantsSettings(BaseModel):
    """Quotas by tenant (weights for fair sharing are the scheduler's ``tenant_weights``)."""

    model_config = _SETTINGS

    quotas: Annotated[dict[TenantName, TenantQuota], Field(max_length=10_000)] = Field(
        default_factory=dict
    )
    # The quota of every tenant not listed (``default`` included); None: no limit.
    default_quota: TenantQuota | None = None
