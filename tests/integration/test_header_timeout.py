"""The header deadline: a client that sends its request headers a byte at a time, or nothing, is
closed (408 with an OpenAI error body if it had sent something) while it is still trickling,
instead of holding its connection forever; requests whose headers are complete are not touched,
however long their body or their answer takes. Real uvicorn servers on localhost, raw sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from ballast.server.header_timeout import HEADER_TIMEOUT_PROTOCOLS
from serverproc import serve_subprocess
from starlette.types import Receive, Scope, Send

TRICKLE = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 400


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """A minimal ASGI app: answers every request with its body's length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        msg = await receive()
        size += len(msg.get("body", b""))
        more = msg.get("more_body", False)
    body = json.dumps({"bytes": size}).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(protocol: type[asyncio.Protocol]) -> Iterator[tuple[str, int]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(echo, http=protocol, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        yield "127.0.0.1", sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


class Trickler:
    """Sends `data` one byte every `every_s` seconds on its own thread, until it is all sent or the
    server closes the connection; `done` tells whether it was still sending when it stopped."""

    def __init__(self, address: tuple[str, int], data: bytes, every_s: float = 0.05) -> None:
        self.sock = socket.create_connection(address)
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._send, args=(data, every_s), daemon=True)
        self._thread.start()

    def _send(self, data: bytes, every_s: float) -> None:
        try:
            for i in range(len(data)):
                self.sock.send(data[i : i + 1])
                time.sleep(every_s)
        except OSError:  # the server closed it
            return
        self.finished.set()

    def answer(self, timeout_s: float = 60.0) -> bytes:
        """Everything the server sends until it closes the connection."""
        self.sock.settimeout(timeout_s)
        out = b""
        try:
            while chunk := self.sock.recv(4096):
                out += chunk
        except ConnectionResetError:  # a byte it sent after the close: what came before stands
            pass
        self.sock.close()
        return out


def assert_timed_out(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"


@pytest.mark.parametrize(
    "protocol", HEADER_TIMEOUT_PROTOCOLS, ids=[b.__name__ for b in HEADER_TIMEOUT_PROTOCOLS]
)
def test_trickled_headers_are_cut_off_and_complete_ones_are_served(protocol: type[asyncio.Protocol]) -> None:
    cls = type(protocol.__name__, (protocol,), {"header_timeout_s": 0.5})
    with serving(cls) as address:
        url = f"http://{address[0]}:{address[1]}"
        slow = [Trickler(address, TRICKLE) for _ in range(5)]  # 400+ bytes at 20 a second: > 20 s
        silent = socket.create_connection(address)  # opens, sends nothing
        # Headers complete, body after twice the header deadline: that is the body's timeout's business.
        late_body = socket.create_connection(address)
        late_body.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        with httpx.Client(base_url=url) as client:  # keep-alive: a second request on the connection
            assert client.post("/", content=b"abc").json() == {"bytes": 3}
            time.sleep(0.2)
            assert client.post("/", content=b"abcd").json() == {"bytes": 4}
        time.sleep(1.0)
        late_body.sendall(b"hello")
        late_body.settimeout(10)
        assert late_body.recv(4096).startswith(b"HTTP/1.1 200")
        late_body.close()
        for t in slow:
            assert_timed_out(t.answer())
            assert not t.finished.is_set()  # cut off while it was still trickling
        silent.settimeout(10)
        assert silent.recv(4096) == b""  # closed without a word: it had asked nothing
        silent.close()


@pytest.mark.slow
def test_ballast_serve_applies_header_timeout_s() -> None:
    """`ballast serve --header-timeout-s 1`: a trickling client gets 408 while a chat is served."""
    args = ["--model", "builtin:tiny-llama", "--max-model-len", "128", "--max-num-seqs", "2"]
    with serve_subprocess([*args, "--header-timeout-s", "1"]) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        slow = Trickler((host, int(port)), TRICKLE, every_s=0.1)
        body = {"model": "builtin:tiny-llama", "prompt": "hi", "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert_timed_out(slow.answer())
        assert not slow.finished.is_set()
        assert httpx.get(url + "/health").status_code == 200
