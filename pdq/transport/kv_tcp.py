"""The KV hand-off's TCP data plane: PushKV's frames over a kept-alive TCP connection.

Python gRPC tops out well below 1 GB/s for a few-MB cache on a small machine; a plain socket
moves the same bytes several times faster. The frames are exactly PushKV's serialized KVChunks
(`kv_transfer.encode_frames`), so the decode worker checks them with the same `Assembler`
(header, reservation, sizes, XXH3 checksum) and fails closed the same way. With internal mTLS
configured, the connection is mutual TLS with the same certificates and name check.

Wire, one hand-off after another on a connection (integers little-endian):
    prefill -> decode:  u32 n, n bytes of traceparent (may be empty);
                        then per frame u32 n (1..MAX_FRAME), n bytes of KVChunk; then u32 0.
    decode -> prefill:  u8 status (0 = accepted, else a grpc.StatusCode value), u32 n,
                        n bytes of UTF-8 details.
The decode worker reads a refused hand-off to its end before it answers, so the connection
stays usable; on a broken connection either side drops it (the scheduler retries the request).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import ssl
import struct
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import grpc

from pdq.transport.mtls import InternalTLS

log = logging.getLogger("pdq.kv_tcp")

MAX_FRAME = 64 << 20
_U32 = struct.Struct("<I")
_STATUS = struct.Struct("<BI")
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Refused(Exception):
    """The hand-off failed with a gRPC status code and details (either side of the wire)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name} {details}")
        self.code, self.details = code, details


def _ssl_context(tls: InternalTLS, server: bool) -> ssl.SSLContext:
    """Mutual TLS with the roles' own CA (the same material the gRPC channels use)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH,
                                     cadata=tls.ca.decode())
    if server:
        ctx.verify_mode = ssl.CERT_REQUIRED
    with tempfile.TemporaryDirectory() as d:  # ssl loads a key only from a file
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cert, tls.cert), (key, tls.key)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)
    return ctx


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """host:port, with an IPv6 host in brackets (the inverse of split_address)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- the decode worker's side ----------------------------------------------------------------

Handler = Callable[[AsyncIterator[bytes], str], Awaitable[None]]


async def serve(host: str, port: int, handle: Handler, tls: InternalTLS | None) -> asyncio.Server:
    """Listens for hand-offs; `handle(frames, traceparent)` consumes one hand-off's frames and
    returns when it is accepted, or raises Refused."""

    async def connection(conn: Receiver) -> None:
        try:
            while True:
                try:
                    traceparent = bytes(await conn.blob()).decode(errors="replace")
                except asyncio.IncompleteReadError:
                    return  # the client closed the connection between hand-offs
                frames = Frames(conn)
                try:
                    await handle(frames, traceparent)
                    code, details = 0, b""
                except Refused as exc:
                    code, details = exc.code.value[0], exc.details.encode()
                async for _ in frames:  # the rest of a refused hand-off, so the connection stays in step
                    pass
                conn.transport.write(_STATUS.pack(code, len(details)) + details)
                if frames.malformed:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass  # a broken connection: drop it (the handler freed what it took)
        except Exception:
            log.exception("KV data plane connection failed")
        finally:
            conn.transport.close()

    ctx = _ssl_context(tls, server=True) if tls else None
    return await asyncio.get_running_loop().create_server(lambda: Receiver(connection), host, port, ssl=ctx)


class Receiver(asyncio.BufferedProtocol):
    """One connection's length-prefixed blobs, each received straight into a buffer of its own
    (a StreamReader would gather the bytes in its own buffer and copy them out again, which
    for a hand-off of megabytes costs more than receiving them)."""

    def __init__(self, on_connect: Callable[["Receiver"], Awaitable[None]]):
        self.on_connect = on_connect
        self.transport: asyncio.BaseTransport | None = None
        self._blobs: collections.deque = collections.deque()  # bytearray, or an int: a length over MAX_FRAME
        self._waiter: asyncio.Future | None = None
        self._eof = self._paused = False
        self._len = bytearray(4)
        self._buf, self._filled = self._len, 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._task = asyncio.get_running_loop().create_task(self.on_connect(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buf)[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled < len(self._buf):
            return
        self._filled = 0
        if self._buf is not self._len:
            self._push(self._buf)
            self._buf = self._len
            return
        (n,) = _U32.unpack(self._len)
        if n > MAX_FRAME:
            self._push(n)
            self.transport.pause_reading()  # the connection is out of step: answer, then close
        elif n == 0:
            self._push(bytearray())
        else:
            self._buf = bytearray(n)

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._wake()

    def _push(self, item: "bytearray | int") -> None:
        self._blobs.append(item)
        if len(self._blobs) > 64 and not self._paused:  # the handler fell behind: stop reading for now
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def blob(self) -> bytearray:
        """The next blob; IncompleteReadError when the connection ended first, Refused
        (INVALID_ARGUMENT) for a length over MAX_FRAME."""
        while not self._blobs:
            if self._eof:
                raise asyncio.IncompleteReadError(b"", None)
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._blobs.popleft()
        if self._paused and len(self._blobs) <= 16:
            self._paused = False
            self.transport.resume_reading()
        if isinstance(item, int):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"KV frame of {item} bytes (at most {MAX_FRAME})")
        return item


class Frames:
    """One hand-off's frames as they arrive; ends at the end marker (an empty blob). A frame
    over MAX_FRAME raises Refused and marks the connection malformed (answered, then closed)."""

    def __init__(self, conn: Receiver):
        self.conn = conn
        self.ended = self.malformed = False

    def __aiter__(self) -> "Frames":
        return self

    async def __anext__(self) -> bytearray:
        if self.ended:
            raise StopAsyncIteration
        try:
            frame = await self.conn.blob()
        except Refused:
            self.ended = self.malformed = True
            raise
        if not frame:
            self.ended = True
            raise StopAsyncIteration
        return frame


# -- the prefill worker's side ---------------------------------------------------------------

class Pusher:
    """Sends hand-offs to decode workers' data planes over kept-alive connections (one per
    hand-off in flight, reused after)."""

    def __init__(self, tls: InternalTLS | None):
        self.tls = tls
        self._ctx = _ssl_context(tls, server=False) if tls else None
        self._idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def _connect(self, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        idle = self._idle.setdefault(address, [])
        while idle:
            reader, writer = idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        self._sweep()
        host, port = split_address(address)
        reader, writer = await asyncio.open_connection(host, port, ssl=self._ctx,
                                                       server_hostname=self.tls.name if self.tls else None)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def push(self, address: str, frames: Iterable[bytes], traceparent: str = "",
                   timeout: float = 30.0) -> None:
        """Sends one hand-off; returns when the decode worker accepted it. Raises Refused (its
        answer, or UNAVAILABLE / DEADLINE_EXCEEDED when the connection fails or is too slow)."""
        writer = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await self._connect(address)
                tp = traceparent.encode()
                writer.write(_U32.pack(len(tp)) + tp)
                for frame in frames:
                    writer.write(_U32.pack(len(frame)))
                    writer.write(frame)
                    await writer.drain()
                writer.write(_U32.pack(0))
                code, n = _STATUS.unpack(await reader.readexactly(_STATUS.size))
                details = (await reader.readexactly(n)).decode(errors="replace")
        except TimeoutError:
            self._drop(writer)
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout:g} s") from None
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError) as exc:
            self._drop(writer)
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"connection failed: {exc or type(exc).__name__}") from None
        except BaseException:
            self._drop(writer)
            raise
        self._idle.setdefault(address, []).append((reader, writer))
        if code:
            raise Refused(_CODES.get(code, grpc.StatusCode.UNKNOWN), details)

    def _sweep(self) -> None:
        """Closes idle connections the other end has closed (a decode worker that left)."""
        for address, idle in list(self._idle.items()):
            for conn in [c for c in idle if c[0].at_eof() or c[1].is_closing()]:
                idle.remove(conn)
                conn[1].close()
            if not idle:
                del self._idle[address]

    @staticmethod
    def _drop(writer: asyncio.StreamWriter | None) -> None:
        if writer is not None:
            writer.close()

    async def close(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()
