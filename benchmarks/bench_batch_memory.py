"""A batch's files never held whole: a 200 MB input file of 50,000 lines uploaded through
``/v1/files``, run as a batch, and its output downloaded through ``/content``, while the serving
process's resident memory is watched against a bound.

    PYTHONPATH=. python benchmarks/bench_batch_memory.py [--lines 50000] [--file-mb 200]
                                                         [--bound-mb 32] [--json]

The server runs in a child process: the gateway's ``FilesApi`` behind its HTTP limits, over a
local store (what ``kvgate run`` serves; the S3 store streams the same way, holding a few parts),
and a ``BatchRun`` over the uploaded file whose requests a stand-in service answers at once (the
feeder's code path from validation to the composed output file, without Kafka). It reports its
resident set after start-up (``VmRSS``) and its peak so far (``VmHWM``) after each phase. This
process is the client: it streams the upload from a file on disk and the download to nowhere.

Reported: the peak's growth over the start-up resident set after each phase (upload, run,
download), in MB; exit status 1 if any is above ``--bound-mb``. What stays is per file and per
batch, not per line (a run keeps ``window`` requests and one segment's outcomes; an upload one
multipart chunk; a download one store chunk), so the bound holds for any file the limits allow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.batch.journal import BatchRecord, FileRecord
from kvgate.batch.run import BatchRun
from kvgate.batch.settings import BatchSettings, StoreKind, StoreSettings
from kvgate.batch.store import LocalStore
from kvgate.gateway.files_api import FilesApi
from kvgate.gateway.settings import ApiKey, ModelRoute
from kvgate.protocol.records import InferenceRequest, ResultStatus
from kvgate.web.guard import HttpLimits, guarded_app
from tests.batch.fakes import MODEL, answer, mapper, record

KEY = ApiKey(name="team", key="k" * 32)
MB = 1_000_000
BOUND_MB = 32.0  # what any phase may add to the server (measured: 14 MB at 200 MB)


def memory_mb() -> dict[str, float]:
    """The resident set now and its peak so far (Linux's /proc), in MB."""
    fields = {}
    for row in Path("/proc/self/status").read_text().splitlines():
        name, _, value = row.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024 / MB
    return {"rss_mb": fields["VmRSS"], "peak_mb": fields["VmHWM"]}


# ---------------------------------------------------------------------- the server (child)
class Book:
    """The gateway's view of the files, without the Kafka topics behind it."""

    def __init__(self) -> None:
        self.files: dict[str, FileRecord] = {}

    async def add_file(self, file: FileRecord) -> None:
        self.files[file.id] = file

    def files_of(self, owner: str) -> list[FileRecord]:
        return [f for f in self.files.values() if f.owner == owner]

    def batches_of(self, owner: str) -> list[BatchRecord]:
        return []

    async def sync(self) -> bool:
        return False


class Ports:
    """A run's world: a service that answers each request as it is sent (no answer kept)."""

    def __init__(self, store: LocalStore, book: Book) -> None:
        self._store = store
        self._book = book
        self.run: BatchRun | None = None
        self._offset = 0

    @property
    def store(self) -> LocalStore:
        return self._store

    async def send(self, route: ModelRoute, request: InferenceRequest) -> None:
        index = int(request.request_id.rpartition(":")[2])
        result = answer(request, self._offset, ResultStatus.COMPLETED)
        self._offset += 1
        assert self.run is not None
        asyncio.get_running_loop().call_soon(self.run.on_answer, index, result, self._offset)

    async def abort(self, request_ids: Sequence[str]) -> None:
        return None

    async def publish(self, record: BatchRecord) -> None:
        return None

    async def add_file(self, record: FileRecord) -> None:
        await self._book.add_file(record)

    def reply_position(self) -> int:
        return self._offset

    async def replies_caught_up(self) -> None:
        return None


def serve(root: Path) -> None:
    settings = BatchSettings(store=StoreSettings(kind=StoreKind.LOCAL, path=root))
    store, book = LocalStore(root), Book()
    files = FilesApi(book, store, settings, lambda _request: KEY, lambda _key: None)  # type: ignore[arg-type]

    async def memory(_request: web.Request) -> web.Response:
        return web.json_response(memory_mb())

    async def run_batch(request: web.Request) -> web.Response:
        batch = record(input_file_id=request.match_info["file_id"], owner=KEY.name)
        ports = Ports(store, book)
        run = BatchRun(batch, epoch=1, ports=ports, mapper=mapper(batch), settings=settings)
        ports.run = run
        final = await run.run()
        return web.json_response(
            {"status": final.status.value, "output_file_id": final.output_file_id}
        )

    app = guarded_app(HttpLimits())  # the gateway's limits (an upload streams past max_body)
    app.add_routes(
        [
            *files.routes(),
            web.get("/bench/memory", memory),
            web.post("/bench/run/{file_id}", run_batch),
        ]
    )

    async def main() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(json.dumps({"port": port}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# ---------------------------------------------------------------------- the client (parent)
def write_input(path: Path, lines: int, file_bytes: int) -> None:
    """``lines`` chat lines of ``file_bytes`` in all (each padded with a long message)."""
    per_line = file_bytes // lines
    with path.open("wb") as out:
        for i in range(lines):
            head = {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user"}]},
            }
            empty = len(json.dumps(head)) + len(', "content": ""') + 1
            head["body"]["messages"][0]["content"] = "x" * max(0, per_line - empty)  # type: ignore[index]
            out.write(json.dumps(head).encode() + b"\n")


async def measure(base: str, data: Path) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(base, timeout=timeout) as http:

        async def memory() -> dict[str, float]:
            async with http.get("/bench/memory") as response:
                return dict(await response.json())

        start = await memory()
        phases["start_rss_mb"] = round(start["rss_mb"], 1)
        began = time.monotonic()
        with data.open("rb") as body:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", body, filename="input.jsonl")
            async with http.post("/v1/files", data=form) as response:
                uploaded = await response.json()
                assert response.status == 200, uploaded
        phases["upload_s"] = round(time.monotonic() - began, 1)
        phases["upload_peak_growth_mb"] = round((await memory())["peak_mb"] - start["rss_mb"], 1)

        began = time.monotonic()
        async with http.post(f"/bench/run/{uploaded['id']}") as response:
            ran = await response.json()
        assert ran["status"] == "completed", ran
        phases["run_s"] = round(time.monotonic() - began, 1)
        phases["run_peak_growth_mb"] = round((await memory())["peak_mb"] - start["rss_mb"], 1)

        began, downloaded = time.monotonic(), 0
        async with http.get(f"/v1/files/{ran['output_file_id']}/content") as response:
            async for chunk in response.content.iter_chunked(1 << 20):
                downloaded += len(chunk)
        phases["download_s"] = round(time.monotonic() - began, 1)
        phases["output_mb"] = round(downloaded / MB, 1)
        end = await memory()
        phases["download_peak_growth_mb"] = round(end["peak_mb"] - start["rss_mb"], 1)
        phases["end_rss_mb"] = round(end["rss_mb"], 1)
    return phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--file-mb", type=float, default=200.0)
    parser.add_argument("--bound-mb", type=float, default=BOUND_MB)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the child's role
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    report = {**measure_memory(args.lines, int(args.file_mb * MB)), "bound_mb": args.bound_mb}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:26s} {value}")
    return 0 if peak_growth_mb(report) <= args.bound_mb else 1


def measure_memory(lines: int, file_bytes: int) -> dict[str, Any]:
    """Upload, run and download a file of ``lines`` lines and ``file_bytes`` through a server
    in a child process; its memory after each phase (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="kvgate-batch-memory-") as tmp:
        data = Path(tmp) / "input.jsonl"
        write_input(data, lines, file_bytes)
        root = Path(tmp) / "store"
        root.mkdir()
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(root)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None
            port = json.loads(child.stdout.readline())["port"]
            phases = asyncio.run(measure(f"http://127.0.0.1:{port}", data))
        finally:
            child.terminate()
            child.wait(30)
    return {"lines": lines, "input_mb": round(file_bytes / MB, 1), **phases}


def peak_growth_mb(report: dict[str, Any]) -> float:
    """The most the server's peak resident set grew over its start-up size, any phase."""
    return max(float(v) for k, v in report.items() if k.endswith("_peak_growth_mb"))


if __name__ == "__main__":
    raise SystemExit(main())
