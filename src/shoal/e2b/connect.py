"""`process.Process/Start` (the SDK's `commands.run`) served straight from aiohttp, without the ASGI bridge.

Every other Connect method goes through connectrpc's ASGI application (asgi.py). Start is the one on every
command's path, and there the bridge and connectrpc's generic per-request machinery (scope dicts, receive/send
closures, one socket write per message) cost more than the command itself (bench/bench_e2b.py). The SDK
sends Start in exactly one shape — Connect streaming, JSON codec (`application/connect+json`), no compression
(e2b's `ENVD_RPC_COMPRESSION`) — so that shape is answered here with the same `ProcessService.start` and the
same generated messages (their own `to_json`/`from_json`, as connectrpc's JSON codec calls them); anything
else (binary codec, compressed bodies, a malformed envelope) returns None and the caller uses connectrpc.

Writes are coalesced: the response headers go out with the start event (one write), and the end event with
the end-of-stream message and the chunked terminator (one write), so a short command costs the client two
reads where the bridge sent four. Output events are still written as they come.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb

from shoal.e2b.envd import ProcessService, connect_error

CONTENT_TYPE = "application/connect+json"
_END_OK = struct.pack(">BI", 2, 2) + b"{}"  # end-of-stream message without an error
MAX_START_BYTES = 4 << 20  # connectrpc's default read_max_bytes: a larger Start is its to refuse


class Context:
    """What `ProcessService.start` reads of connectrpc's RequestContext."""

    __slots__ = ("request_headers", "timeout_ms")

    def __init__(self, headers: Any, timeout_ms: int | None) -> None:
        self.request_headers = headers
        self.timeout_ms = timeout_ms


class _Streaming(web.StreamResponse):
    # hold the headers back until the first body write (aiohttp then sends both in one write)
    _send_headers_immediately = False


def _frame(message: Any) -> bytes:
    data = message.to_json().encode()
    return struct.pack(">BI", 0, len(data)) + data


def _end_error(exc: ConnectError) -> bytes:
    data = json.dumps({"error": {"code": exc.code.value, "message": exc.message}}).encode()
    return struct.pack(">BI", 2, len(data)) + data


def _is_end(message: process_pb.StartResponse) -> bool:
    event = message.event
    return event is not None and event.event is not None and event.event.field == "end"


async def serve_start(service: ProcessService, request: web.Request) -> tuple[web.StreamResponse | None, bytes]:
    """(the response, b"") or, for a request this does not answer, (None, what it read of the body): the caller
    hands both to connectrpc."""
    headers = request.headers
    if headers.get("Content-Type") != CONTENT_TYPE or headers.get("Connect-Content-Encoding", "identity") != "identity":
        return None, b""
    # The request's one envelope, read as soon as it is whole: the SDK sends the body chunked, its end (the
    # chunked terminator) in a later write, which the command need not wait for (aiohttp reads it after).
    content = request.content
    body = b""
    try:
        body = await content.readexactly(5)
        size = int.from_bytes(body[1:5], "big")
        if body[0] != 0 or size > MAX_START_BYTES:
            return None, body  # connectrpc answers it (with its own error)
        body += await content.readexactly(size)
        timeout = headers.get("Connect-Timeout-Ms")
        message = process_pb.StartRequest.from_json(body[5:], ignore_unknown_fields=True)
        timeout_ms = int(timeout) if timeout else None
    except asyncio.IncompleteReadError as exc:
        return None, body + exc.partial
    except Exception:  # noqa: BLE001 - connectrpc decodes it again and answers with its error
        return None, body
    response = _Streaming(status=200, headers={"Content-Type": CONTENT_TYPE})
    await response.prepare(request)
    try:
        end = await run_start(service, message, Context(headers, timeout_ms), response.write)
    except ConnectionError:  # the client went away (the events were closed: the command goes on, detached)
        return response, b""
    with contextlib.suppress(ConnectionError):  # the client went away as the stream ended
        await response.write_eof(end)
    return response, b""


async def run_start(
    service: ProcessService, message: process_pb.StartRequest, ctx: Context, write: Callable[[bytes], Awaitable[Any]]
) -> bytes:
    """Run Start, each event but the last framed and given to `write` as it comes; returns what ends the
    stream (the end event's frame, if any, and the end-of-stream message, with the error if there was one),
    for the caller to send with the stream's end in one write. ConnectionError from `write`: the client went
    away (the events are closed; the command goes on, detached)."""
    end = b""
    try:
        async with contextlib.aclosing(service.start(message, ctx)) as events:
            async for event in events:
                if _is_end(event):
                    end = _frame(event)  # written with the end-of-stream message
                else:
                    await write(_frame(event))
    except ConnectionError:
        raise
    except ConnectError as exc:
        end += _end_error(exc)
    except Exception as exc:  # noqa: BLE001 - ends the stream with the error, as connectrpc does
        end += _end_error(connect_error(exc))
    else:
        end += _END_OK
    return end
