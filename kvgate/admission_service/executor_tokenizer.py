"""The pool's tokenizer, taken from its executors (``executors.tokenizer_from_executors``).

Each executor serves its model's tokenizer at ``GET /v1/tokenizer`` with the step token. Before a
session opens, the service fetches it: the first executor's tokenizer (or its having none)
becomes the pool's, and an executor that serves another — a different model, or none where the
others have one — is not connected; its membership entry says why, and it is retried with the
usual back-off, so fixing the pool is all it takes. Text prompts that arrive before any executor
has answered wait for one (``limits.tokenizer_wait_s``: a replica that has just started, or
whose executors are given to it a moment later), then are rejected with that reason. The pool's
tokenizer is kept for the life of the service: a pool that changes its model restarts its
admission service (the operator does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Final
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from pydantic import ValidationError

from kvgate.admission_service.executor_client import ConnectFailed, Connector, StepSession
from kvgate.admission_service.tokenizer import FileTokenizer, TokenizerError, tokenizer_from_files
from kvgate.admission_service.tool_parsers import ToolCallFormat
from kvgate.protocol.records import ChatMessage
from kvgate.protocol.tokenizer_files import TOKENIZER_PATH, TokenizerFiles
from kvgate.protocol.tools import ToolDefinition

log = logging.getLogger(__name__)

NO_TOKENIZER: Final = "none"  # the digest of "this executor's model has no tokenizer"


def tokenizer_url(steps_endpoint: str) -> str:
    """``ws://host:8000/v1/steps`` → ``http://host:8000/v1/tokenizer`` (wss → https)."""
    parts = urlsplit(steps_endpoint)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, TOKENIZER_PATH, "", ""))


def _describe(digest: str) -> str:
    return "no tokenizer" if digest == NO_TOKENIZER else f"tokenizer {digest[:12]}"


class PoolTokenizer:
    """A :class:`TextCodec` that is the tokenizer every connected executor agreed on."""

    def __init__(self, tool_call_format: ToolCallFormat = ToolCallFormat.AUTO) -> None:
        self._tool_call_format = tool_call_format
        self._lock = threading.Lock()  # adopted on the loop, used on tokenizer threads
        self._digest: str | None = None
        self._source: str | None = None
        self._codec: FileTokenizer | None = None
        self._known = asyncio.Event()  # set on the loop once an executor's tokenizer is adopted

    @property
    def digest(self) -> str | None:
        """The pool's tokenizer digest (``"none"`` for a model without one), None until known."""
        return self._digest

    def adopt(self, executor: str, files: TokenizerFiles | None) -> None:
        """Take ``files`` as the pool's tokenizer, or check that they are the pool's; raises
        TokenizerError naming both executors when they disagree."""
        digest = NO_TOKENIZER if files is None else files.digest
        with self._lock:
            if self._digest is not None:
                if digest != self._digest:
                    raise TokenizerError(
                        f"executor {executor} serves {_describe(digest)}, but this pool's "
                        f"executors serve {_describe(self._digest)} (first from {self._source}); "
                        "every executor of a pool must run the same model"
                    )
                return
        codec = (
            None if files is None else tokenizer_from_files(files, executor, self._tool_call_format)
        )
        with self._lock:
            if self._digest is None:
                self._digest, self._source, self._codec = digest, executor, codec
                log.info("pool tokenizer from %s: %s", executor, _describe(digest))
                self._known.set()
            elif digest != self._digest:
                raise TokenizerError(f"executor {executor} disagrees with {self._source}")

    async def known(self, timeout_s: float) -> bool:
        """Whether the pool's tokenizer is known, waiting up to ``timeout_s`` for it."""
        if self._digest is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._known.wait(), timeout_s)
        return self._digest is not None

    def _require(self) -> FileTokenizer:
        codec = self._codec
        if codec is not None:
            return codec
        if self._digest is None:
            raise TokenizerError(
                "no executor of this pool has served its tokenizer yet; text prompts are "
                "accepted once one is connected (send prompt_token_ids meanwhile)"
            )
        raise TokenizerError(
            "this pool's model has no tokenizer (its executors serve none); send prompt_token_ids"
        )

    def encode(self, text: str) -> list[int]:
        return self._require().encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self._require().decode(token_ids)

    def decode_with_special(self, token_ids: list[int]) -> str:
        return self._require().decode_with_special(token_ids)

    def render_chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolDefinition] | None = None
    ) -> str:
        return self._require().render_chat(messages, tools)

    def tool_call_format(self) -> ToolCallFormat:
        return self._require().tool_call_format()


async def fetch_tokenizer(
    http: aiohttp.ClientSession, steps_endpoint: str, token: str, timeout_s: float
) -> TokenizerFiles | None:
    """The executor's tokenizer, None when its model has none; ConnectFailed otherwise."""
    url = tokenizer_url(steps_endpoint)
    try:
        async with http.get(
            url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            if response.status == 404:
                return None
            if response.status != 200:
                raise ConnectFailed(f"{url}: HTTP {response.status} {response.reason}")
            body = await response.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise ConnectFailed(f"{url}: {exc or type(exc).__name__}") from exc
    try:
        return TokenizerFiles.model_validate_json(body)
    except ValidationError as exc:
        raise ConnectFailed(f"{url}: not a tokenizer: {exc.errors()[0]['msg']}") from exc


class TokenizerCheckingConnector:
    """Opens a session only to an executor whose tokenizer is the pool's."""

    def __init__(
        self,
        inner: Connector,
        pool: PoolTokenizer,
        http: aiohttp.ClientSession,
        token: str,
        *,
        timeout_s: float,
    ) -> None:
        self._inner = inner
        self._pool = pool
        self._http = http
        self._token = token
        self._timeout_s = timeout_s

    async def __call__(self, endpoint: str, epoch: int) -> StepSession:
        files = await fetch_tokenizer(self._http, endpoint, self._token, self._timeout_s)
        try:
            self._pool.adopt(endpoint, files)
        except TokenizerError as exc:
            raise ConnectFailed(str(exc)) from exc
        return await self._inner(endpoint, epoch)
