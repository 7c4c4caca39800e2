"""The daemon's stdio reader (lsp.server.ChunkReader), on byte streams alone; every e2e
test drives it over a real pipe."""

import asyncio
import io
import json

from codecomplete.lsp.server import ChunkReader


class Trickle(io.RawIOBase):
    """A stream that hands out at most ``step`` bytes per read, as a pipe does when the
    writer is slow."""

    def __init__(self, data: bytes, step: int):
        self.data, self.step = data, step

    def readable(self) -> bool:
        return True

    def read1(self, n: int = -1) -> bytes:
        out, self.data = self.data[:min(n, self.step)], self.data[min(n, self.step):]
        return out


def frame(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return b"Content-Length: %d\r\n\r\n" % len(raw) + raw


def read_messages(stream) -> list:
    """What pygls's loop reads: header lines up to a blank one, then the body."""
    async def go():
        reader, out = ChunkReader(stream), []
        while True:
            length = 0
            while True:
                line = await reader.readline()
                if not line:
                    return out
                if line.startswith(b"Content-Length: "):
                    length = int(line.split(b":")[1])
                elif line == b"\r\n":
                    break
            out.append(json.loads(await reader.readexactly(length)))
    return asyncio.run(go())


def test_messages_come_whole_however_the_pipe_splits_them():
    """Guards the reader: lines and bodies split across reads (one byte at a time, or many
    messages in one read) come back whole and in order, a body with newlines inside too,
    and the end of the stream ends the loop."""
    bodies = [{"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {"text": "a\nb\r\n" * k}}
              for k in range(1, 40)]
    data = b"".join(frame(b) for b in bodies)
    for step in (1, 7, 100, 1 << 20):
        assert read_messages(Trickle(data, step)) == bodies, step
    assert read_messages(io.BytesIO(data)) == bodies  # a buffered stream (read1 of BufferedReader-likes)


def test_a_stream_cut_mid_body_returns_what_came():
    async def go():
        reader = ChunkReader(Trickle(b"Content-Length: 10\r\n\r\n{\"a\"", 3))
        assert await reader.readline() == b"Content-Length: 10\r\n"
        assert await reader.readline() == b"\r\n"
        assert await reader.readexactly(10) == b'{"a"'  # what there was
        assert await reader.readline() == b""
    asyncio.run(go())


def test_pygls_loop_reads_every_message_through_it():
    """Guards the reader inside pygls's own loop (run_async, as the daemon runs it): messages
    with a Content-Type header too, split one byte at a time, are each handled once, in order."""
    import threading

    from pygls.io_ import run_async

    class Protocol:
        def __init__(self):
            self.seen = []

        def structure_message(self, data):
            return data

        def handle_message(self, message):
            self.seen.append(message)

    bodies = [{"jsonrpc": "2.0", "method": "m", "params": {"i": i, "text": "x\n" * i}} for i in range(12)]
    data = b""
    for i, body in enumerate(bodies):
        raw = json.dumps(body).encode()
        typed = b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n" if i % 2 else b""
        data += b"Content-Length: %d\r\n" % len(raw) + typed + b"\r\n" + raw
    for step in (1, 5, 1 << 16):
        protocol = Protocol()
        asyncio.run(run_async(stop_event=threading.Event(), reader=ChunkReader(Trickle(data, step)),
                              protocol=protocol))
        assert protocol.seen == bodies, step


def test_each_handler_starts_before_the_next_message_is_handled():
    """Guards the turn the reader gives the event loop between messages: with a request and
    its ``$/cancelRequest`` in one chunk, the request's handler task must have started (so it
    sees, and counts, its own cancellation) before the cancel is handled, as pygls's reader
    allowed.  Without the turn every message of a chunk is handled before any task runs."""
    import threading

    from pygls.io_ import run_async

    order = []

    class Protocol:
        def structure_message(self, data):
            return data

        def handle_message(self, message):
            i = message["params"]["i"]
            order.append(("handled", i))

            async def handler():
                order.append(("started", i))
            asyncio.ensure_future(handler())

    data = b"".join(frame({"jsonrpc": "2.0", "method": "m", "params": {"i": i}}) for i in range(5))

    async def go():
        await run_async(stop_event=threading.Event(), reader=ChunkReader(io.BytesIO(data)), protocol=Protocol())
        await asyncio.sleep(0)

    asyncio.run(go())
    assert order == [(kind, i) for i in range(5) for kind in ("handled", "started")]
