"""--tcp: the same server over a loopback socket, spoken to with raw JSON-RPC framing."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def rpc(reader, writer, msg_id, method, params):
    body = json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}).encode()
    writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    while True:
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        message = json.loads(await reader.readexactly(length))
        if message.get("id") == msg_id:
            return message


@pytest.mark.asyncio
async def test_tcp_serves_initialize_and_completions(repo, tiny_model, model_cache):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "codecomplete.daemon", "--repo", str(repo),
                             "--model", str(tiny_model), "--dtype", "float32", "--tcp", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for _ in range(200):  # the listener comes up after Python's imports
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("daemon did not listen on its port")
        init = await rpc(reader, writer, 1, "initialize", {"processId": None, "rootUri": repo.as_uri(),
                                                           "capabilities": {}})
        assert "inlineCompletionProvider" in init["result"]["capabilities"]
        uri = (repo / "util.py").as_uri()
        result = await rpc(reader, writer, 2, "textDocument/inlineCompletion", {
            "textDocument": {"uri": uri}, "position": {"line": 5, "character": 17},
            "context": {"triggerKind": 1}})
        assert "items" in result["result"]  # served from the file on disk
        writer.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.stdout.read() == b""  # nothing leaks to stdout in TCP mode either
