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


def send(writer, obj) -> None:
    body = json.dumps(obj).encode()
    writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.asyncio
async def test_tcp_daemon_outlives_its_clients_one_at_a_time(repo, tiny_model, model_cache):
    """Guards --tcp as a daemon: a client that drops or exits leaves it listening, the next
    client starts from a fresh protocol (the last client's buffers and settings are gone),
    and a client that connects while another is served gets an error answer."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "codecomplete.daemon", "--repo", str(repo),
                             "--model", str(tiny_model), "--dtype", "float32", "--tcp", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    uri = (repo / "only_in_a_buffer.py").as_uri()
    complete = {"textDocument": {"uri": uri}, "position": {"line": 1, "character": 11},
                "context": {"triggerKind": 1}}

    async def connect():
        for _ in range(200):
            try:
                return await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.1)
        pytest.fail("daemon did not listen on its port")

    lib = repo.parent / "lib"
    lib.mkdir()
    (lib / "shared.py").write_text("def shared_helper():\n    return 1\n")

    async def initialize(reader, writer, options=None, folders=()):
        init = await asyncio.wait_for(rpc(reader, writer, 1, "initialize", {
            "processId": None, "rootUri": repo.as_uri(), "capabilities": {},
            "workspaceFolders": [{"uri": f.as_uri(), "name": f.name} for f in folders] or None,
            "initializationOptions": options}), 60)
        send(writer, {"jsonrpc": "2.0", "method": "initialized", "params": {}})
        return init

    try:
        # the first client turns speculation off, has a second workspace folder, opens a
        # buffer, completes in it, and drops without a word
        reader, writer = await connect()
        assert "result" in await initialize(reader, writer, {"codecomplete": {"speculation": {"enabled": False}}},
                                            folders=(repo, lib))
        stats = await asyncio.wait_for(rpc(reader, writer, 9, "codecomplete/stats", {}), 30)
        assert stats["result"]["engine"]["speculation"] is False
        assert [f["root"] for f in stats["result"]["folders"]] == [str(repo.resolve()), str(lib.resolve())]
        send(writer, {"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": uri, "languageId": "python", "version": 1, "text": "def add(a, b):\n    return "}}})
        got = await asyncio.wait_for(rpc(reader, writer, 2, "textDocument/inlineCompletion", complete), 60)
        assert "items" in got["result"]
        writer.close()
        # the next client: a fresh protocol and the daemon's own settings, where that
        # buffer was never opened
        reader, writer = await connect()
        assert "result" in await initialize(reader, writer)
        stats = await asyncio.wait_for(rpc(reader, writer, 9, "codecomplete/stats", {}), 30)
        assert stats["result"]["engine"]["speculation"] is True
        assert [f["root"] for f in stats["result"]["folders"]] == [str(repo.resolve())]  # its folders only
        got = await asyncio.wait_for(rpc(reader, writer, 2, "textDocument/inlineCompletion", complete), 60)
        assert got["error"]["code"] == -32602 and "does not exist" in got["error"]["message"]
        # a second client while this one is served
        other_reader, other_writer = await connect()
        refused = await initialize(other_reader, other_writer)
        assert refused["error"]["code"] == -32803 and "another client" in refused["error"]["message"]
        try:  # closed: an end of file, or a reset where its "initialized" met the closed socket
            assert await asyncio.wait_for(other_reader.read(), 10) == b""
        except ConnectionResetError:
            pass
        # shutdown and exit end this connection, not the daemon
        assert (await asyncio.wait_for(rpc(reader, writer, 3, "shutdown", None), 30))["result"] is None
        send(writer, {"jsonrpc": "2.0", "method": "exit", "params": None})
        assert await asyncio.wait_for(reader.read(), 10) == b""
        reader, writer = await connect()
        assert "result" in await initialize(reader, writer)
        writer.close()
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=10)
