"""The hostile benches' HTTP/1.1 client, on plain asyncio streams (no client library between the
bytes and the server): one keep-alive connection, a request head, a response, the bench's key."""

from __future__ import annotations

import asyncio

KEY = "bench"
CHAT = "/v1/chat/completions"
MIB = 1 << 20


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of one response with a Content-Length."""
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


def post_head(path: str, headers: dict[str, str]) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()


class Conn:
    """One keep-alive connection (``local``: the client's own address, another client of the fair gate)."""

    def __init__(self, port: int, local: str | None = None) -> None:
        self.port, self.local = port, local

    async def open(self) -> Conn:
        kw = {"local_addr": (self.local, 0)} if self.local else {}
        self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port, **kw)
        return self

    async def post(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        self.w.write(post_head(CHAT, {"Content-Length": str(len(body)), **headers}) + body)
        await self.w.drain()
        return await read_response(self.r)

    def close(self) -> None:
        self.w.close()


def auth(key: str = KEY, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **extra}


def p_ms(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (seconds) in milliseconds, one decimal (nan when empty)."""
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 1) if xs else float("nan")
