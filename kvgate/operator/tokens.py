"""Per-pool admin API tokens, derived from the operator's key instead of read back from Secrets.

```
token(pool) = base64url(HMAC-SHA256(key, "kvgate-admin-token" 0 namespace 0 name 0 uid))
```
The operator writes each pool's token into ``<pool>-admin-token`` once (``create``) for the
admission pod to mount, and never reads a Secret: its RBAC grants ``create`` on Secrets and
nothing else, so it cannot read any Secret in the namespaces it watches — not even its own.
The uid makes a re-created pool of the same name get a new token. The key comes from
``KVGATE_OPERATOR_TOKEN_KEY_FILE`` (the chart makes and mounts it, kept across upgrades) or
``KVGATE_OPERATOR_TOKEN_KEY``.

A Secret of that name holding another token (made by hand, or by an operator with another key)
cannot be repaired without reading it: the admin API then refuses the operator, and the pool's
status says to delete the Secret, which the operator then writes again.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from typing import Final

MIN_KEY_BYTES: Final = 32


@dataclass(frozen=True)
class TokenKey:
    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) < MIN_KEY_BYTES:
            raise ValueError(
                f"the operator's token key has {len(self.key)} bytes; at least {MIN_KEY_BYTES}"
            )

    def __repr__(self) -> str:
        return "TokenKey(<hidden>)"

    def admin_token(self, namespace: str, name: str, uid: str) -> str:
        message = b"\0".join(
            (b"kvgate-admin-token", namespace.encode(), name.encode(), uid.encode())
        )
        digest = hmac.new(self.key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
