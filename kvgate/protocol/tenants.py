"""Tenant names, shared by the request record, the gateway's keys, the scheduler's weights and the
service's quotas (one rule for what a tenant name is)."""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import Field

TENANT_PATTERN: Final = r"^[A-Za-z0-9._-]{1,64}$"
TenantName = Annotated[str, Field(min_length=1, max_length=64, pattern=TENANT_PATTERN)]

DEFAULT_TENANT: Final = "default"
"""The tenant of a request that names none."""
