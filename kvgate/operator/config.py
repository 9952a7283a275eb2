"""Operator settings (environment, ``KVGATE_OPERATOR_*``) and the kopf settings derived from them.

``configure_kopf`` is called from the ``on.startup`` handler only, as kopf intends.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Annotated

import kopf
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvgate.backoff import Uniform, jittered_delay_s
from kvgate.operator.admin import (
    DEFAULT_POD_URL_TEMPLATE,
    DEFAULT_URL_TEMPLATE,
    check_pod_url_template,
    check_url_template,
)
from kvgate.operator.naming import KOPF_FINALIZER, KOPF_PREFIX, LABEL_POOL, MANAGED_BY
from kvgate.operator.tokens import TokenKey


class OperatorConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_OPERATOR_", frozen=True)

    # Where a pool's admin API answers; {pool} and {namespace} are filled in.
    admin_url_template: str = DEFAULT_URL_TEMPLATE
    # Where one admission pod's admin API answers ({pod_ip}): pools of several replicas, whose
    # replicas are each told their own shard of the executors.
    admin_pod_url_template: str = DEFAULT_POD_URL_TEMPLATE
    # Image of the admission service when a pool does not name one (set by the chart).
    admission_image: str | None = None
    # How often to look again while something is in progress that no watch event reports:
    # a drain, or an admin API that did not answer.
    poll_interval_s: Annotated[float, Field(gt=0.0, le=600.0)] = 5.0
    # How often to look again while waiting for what pod events report anyway (executors
    # becoming ready): a guard against a missed event, not the way progress is noticed.
    resync_interval_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 30.0
    # Upper bound of the retry delay after failed API calls (it doubles from poll_interval_s).
    max_backoff_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 60.0
    request_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = 10.0
    # The key per-pool admin tokens are derived from (tokens.py): a file (the chart mounts one)
    # or the value itself; exactly one.
    token_key_file: Path | None = None
    token_key: SecretStr | None = None

    @model_validator(mode="after")
    def _one_key(self) -> OperatorConfig:
        if (self.token_key_file is None) == (self.token_key is None):
            raise ValueError(
                "set exactly one of KVGATE_OPERATOR_TOKEN_KEY_FILE and KVGATE_OPERATOR_TOKEN_KEY "
                "(the key per-pool admin tokens are derived from)"
            )
        if self.token_key is not None:
            TokenKey(self.token_key.get_secret_value().encode())  # long enough
        return self

    def read_token_key(self) -> TokenKey:
        """The key, read from its file when one is named (raises OSError/ValueError)."""
        if self.token_key is not None:
            return TokenKey(self.token_key.get_secret_value().encode())
        assert self.token_key_file is not None
        return TokenKey(self.token_key_file.read_bytes().strip())

    @field_validator("admin_url_template")
    @classmethod
    def _template(cls, value: str) -> str:
        check_url_template(value)
        return value

    @field_validator("admin_pod_url_template")
    @classmethod
    def _pod_template(cls, value: str) -> str:
        check_pod_url_template(value)
        return value

    def retry_delay_s(self, retry: int, uniform: Uniform = random.uniform) -> float:
        """Backoff after the ``retry``-th consecutive failure (0-based), jittered
        (``kvgate/backoff.py``): poll_interval_s doubled per failure, capped at max_backoff_s."""
        initial_s = min(self.poll_interval_s, self.max_backoff_s)
        return jittered_delay_s(
            retry, initial_s=initial_s, max_s=self.max_backoff_s, uniform=uniform
        )


def configure_kopf(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    # kopf's bookkeeping in our own group, in annotations (the status belongs to the pool).
    settings.persistence.finalizer = KOPF_FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.posting.reporting_component = MANAGED_BY
    settings.posting.event_name_prefix = "kvgate-"
    # Waiting is flow control (TemporaryError), which kopf logs at ERROR on every retry; as
    # Events that would be noise. The operator posts its own Events for what changed and for
    # the first failure of a streak; kopf's messages stay in the log.
    settings.posting.level = logging.CRITICAL
    # Watch only the pods of pools (server-side label selector), not every pod in the cluster.
    settings.watching.label_selectors["v1", "pods"] = LABEL_POOL
    # Namespaces are given explicitly (or all); no need to list namespaces and CRDs.
    settings.scanning.disabled = True
    # Peering is not set here: ``kvgate operator`` passes a peering name (which kopf makes
    # mandatory: no peering resource, no processing) unless it runs --standalone.
    settings.networking.request_timeout = config.request_timeout_s
