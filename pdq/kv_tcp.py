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
import os
import socket
import ssl
import struct
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import grpc

from pdq.mtls import InternalTLS

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


# -- the decode worker's side ----------------------------------------------------------------

Handler = Callable[[AsyncIterator[bytes], str], Awaitable[None]]


async def serve(host: str, port: int, handle: Handler, tls: InternalTLS | None) -> asyncio.Server:
    """Listens for hand-offs; `handle(frames, traceparent)` consumes one hand-off's frames and
    returns when it is accepted, or raises Refused."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    (n,) = _U32.unpack(await reader.readexactly(4))
                except asyncio.IncompleteReadError:
                    return  # the client closed the connection between hand-offs
                traceparent = (await reader.readexactly(n)).decode(errors="replace") if n else ""
                frames = Frames(reader)
                try:
                    await handle(frames, traceparent)
                    code, details = 0, b""
                except Refused as exc:
                    code, details = exc.code.value[0], exc.details.encode()
                async for _ in frames:  # the rest of a refused hand-off, so the connection stays in step
                    pass
                writer.write(_STATUS.pack(code, len(details)) + details)
                await writer.drain()
                if frames.malformed:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass  # a broken connection: drop it (the handler freed what it took)
        finally:
            writer.close()

    ctx = _ssl_context(tls, server=True) if tls else None
    return await asyncio.start_server(connection, host, port, ssl=ctx, limit=MAX_FRAME + 4)


class Frames:
    """One hand-off's frames as they arrive; ends at the end marker. A frame over MAX_FRAME
    raises Refused and marks the connection malformed (it is answered, then closed)."""

    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader
        self.ended = self.malformed = False

    def __aiter__(self) -> "Frames":
        return self

    async def __anext__(self) -> bytes:
        if self.ended:
            raise StopAsyncIteration
        (n,) = _U32.unpack(await self.reader.readexactly(4))
        if n == 0 or n > MAX_FRAME:
            self.ended = True
            if n == 0:
                raise StopAsyncIteration
            self.malformed = True
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"KV frame of {n} bytes (at most {MAX_FRAME})")
        return await self.reader.readexactly(n)


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

    @staticmethod
    def _drop(writer: asyncio.StreamWriter | None) -> None:
        if writer is not None:
            writer.close()

    async def close(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()
