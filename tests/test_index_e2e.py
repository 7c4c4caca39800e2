"""The index inside the real daemon: an LSP client over stdio sees retrieval follow
unsaved buffers and files saved on disk; the ``index`` command prints its stats."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import pytest_asyncio

from codecomplete.lsp.server import plain

from .lsp_client import open_doc, start_daemon, stats

ASYNC = pytest.mark.asyncio(loop_scope="function")


@pytest_asyncio.fixture
async def client(repo, tiny_model, tmp_path):
    c = await start_daemon(repo, tiny_model, extra_args=("--index-dir", str(tmp_path / "index")))
    yield c
    await c.shutdown_session()
    await c.stop()


async def retrieve(client, uri: str, line: int, character: int) -> dict:
    return plain(await client.protocol.send_request_async(
        "codecomplete/retrieve", {"textDocument": {"uri": uri}, "position": {"line": line, "character": character}}))


async def until(fn, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = await fn()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.1)


@ASYNC
async def test_retrieve_with_malformed_params_answers_invalid_params(client, repo):
    """Guards the custom request: its params are not checked by lsprotocol's types."""
    from pygls.exceptions import JsonRpcException

    good = {"textDocument": {"uri": (repo / "util.py").as_uri()}, "position": {"line": 0, "character": 0}}
    bad = [{}, [], {"textDocument": [], "position": {}}, {**good, "textDocument": {"uri": ["x"]}},
           {**good, "position": {"line": "1", "character": 0}}, {**good, "position": {"line": -1, "character": 0}},
           {**good, "position": {"line": True, "character": 0}}, {**good, "limit": "many"},
           {**good, "draftLength": "long"}]
    for params in bad:
        try:
            got = await client.protocol.send_request_async("codecomplete/retrieve", params)
        except JsonRpcException as err:
            assert err.code == -32602, params
        else:
            pytest.fail(f"{params} answered {got}")
    assert "snippets" in plain(await client.protocol.send_request_async("codecomplete/retrieve", good))


@ASYNC
async def test_retrieval_sees_unsaved_buffers_and_saved_files(client, repo):
    """Guards parts 3-5: the watcher, the open-buffer overlay, snippets and drafts."""
    data = await until(lambda: _ready(client))
    assert data["index"]["ready"] and data["index"]["files_indexed"] >= 1  # util.py (latin1.py skipped)
    assert data["index"]["skipped"].get("not_utf8") == 1

    # an unsaved buffer defines a function; another file uses it
    lib = (repo / "shipping.py").as_uri()
    open_doc(client, lib, "def compute_shipping_cost(order, region):\n    rate = RATES[region]\n"
                          "    return order.weight * rate\n")
    main = (repo / "main.py").as_uri()
    text = "from shipping import compute_shipping_cost\n\ntotal = compute_shipping_cost("
    open_doc(client, main, text)

    async def found():
        r = await retrieve(client, main, 2, len("total = compute_shipping_cost("))
        return r if r["snippets"] else None

    r = await until(found)
    assert r and r["snippets"][0]["path"] == "shipping.py"
    assert r["snippets"][0]["reason"] == "definition of compute_shipping_cost"

    # a file saved outside the editor becomes retrievable, drafts included
    (repo / "saved.py").write_text("def parse_config_file(path):\n    with open(path) as handle:\n"
                                   "        return handle.read().splitlines()\n")
    probe = "def parse_config_file(path):\n    with open(path) as handle:\n        return "
    other = (repo / "probe.py").as_uri()
    open_doc(client, other, probe)

    async def drafted():
        r = await retrieve(client, other, 2, len("        return "))
        texts = [c["text"] for d in r["drafts"] if d["source"] == "repository" for c in d["continuations"]]
        return texts if any(t.startswith("handle") for t in texts) else None

    assert await until(drafted)


async def _ready(client):
    data = await stats(client)
    idx = data.get("index") or {}
    return data if idx.get("ready") and idx.get("drafts") else None


@ASYNC
async def test_prompt_context_from_the_index(repo, tiny_model, tmp_path):
    """With contextSnippets on, a completion's prompt opens with the definition of a
    name used at the cursor, found in another (unsaved) buffer."""
    from .lsp_client import complete

    c = await start_daemon(repo, tiny_model, extra_args=("--index-dir", str(tmp_path / "index")),
                           init_options={"completion": {"contextSnippets": 2}})
    try:
        await until(lambda: _ready(c))
        open_doc(c, (repo / "geometry.py").as_uri(), "def circle_area(radius):\n    return 3.14159 * radius ** 2\n")
        uri = (repo / "main.py").as_uri()
        text = "from geometry import circle_area\n\nprint(circle_area("
        open_doc(c, uri, text)

        async def overlay_in():
            return (await retrieve(c, uri, 2, 18))["snippets"]

        assert await until(overlay_in)
        await complete(c, uri, 2, len("print(circle_area("))
        data = await stats(c)
        assert data["counters"]["with_context"] == 1 and data["engine"]["completions"] == 1
    finally:
        await c.shutdown_session()
        await c.stop()


@ASYNC
async def test_retrieve_rejects_bad_params(client, repo):
    from pygls.exceptions import JsonRpcException

    with pytest.raises(JsonRpcException):
        await client.protocol.send_request_async("codecomplete/retrieve", {"position": {}})
    uri = (repo / "util.py").as_uri()
    with pytest.raises(JsonRpcException):
        await retrieve(client, uri, 400, 0)
    assert (await stats(client))["index"] is not None  # still serving


def test_index_command_prints_stats(repo, tiny_model, tmp_path):
    cmd = [sys.executable, "-m", "codecomplete.daemon", "index", "--repo", str(repo),
           "--model", str(tiny_model), "--index-dir", str(tmp_path / "idx"), "--json"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["files"] == 1 and out["tokens"] > 0 and out["bytes"] > 0 and out["seconds"] >= 0
    assert out["files_skipped"] == 1  # latin1.py is not UTF-8
    (repo / "more.py").write_text("def more():\n    return 2\n")
    again = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout)
    assert again["files"] == 2 and again["files_indexed"] == 1 and again["files_unchanged"] == 1
    missing = subprocess.run([sys.executable, "-m", "codecomplete.daemon", "index", "--repo",
                              str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not a directory" in missing.stderr


@ASYNC
async def test_completions_use_retrieval_speculation_with_the_same_text(repo, tiny_model, tmp_path):
    """Guards #8 part 5: inline completions draft from the repository and the verified
    cache and still return what greedy decoding returns (speculation off)."""
    from lsprotocol import types as T

    from .lsp_client import complete

    c = await start_daemon(repo, tiny_model, extra_args=("--index-dir", str(tmp_path / "index")),
                           init_options={"completion": {"mode": "multi", "maxTokens": 24, "maxLines": 50},
                                         "speculation": {"enabled": False}})
    try:
        await until(lambda: _ready(c))
        greedy = ""
        for i, prefix in enumerate(["import os\n\n\ndef main(", "import os\n\nx = os.path.",
                                    "import os\n\n\nfor i in range(", "def f(path):\n    return path."]):
            line, col = prefix.count("\n"), len(prefix.rsplit("\n", 1)[-1])
            uri = (repo / f"a{i}.py").as_uri()
            open_doc(c, uri, prefix)
            plain_items = await complete(c, uri, line, col)
            greedy = plain_items[0].insert_text if plain_items else ""  # from the line's start
            if len(greedy) > len(prefix.rsplit("\n", 1)[-1]) + 8:
                break
        assert greedy, "the tiny model completes none of the candidate prompts"
        # the greedy text lands in the repository: a saved file the watcher indexes
        (repo / "saved.py").write_text(prefix[:prefix.rfind("\n") + 1] + greedy + "\n")
        c.workspace_did_change_configuration(T.DidChangeConfigurationParams(
            settings={"codecomplete": {"speculation": {"enabled": True}}}))
        for name in ("b.py", "c.py"):
            uri = (repo / name).as_uri()
            open_doc(c, uri, prefix)
            items = await complete(c, uri, line, col)
            assert (items[0].insert_text if items else "") == greedy
        data = await stats(c)
        assert data["engine"]["speculation"] is True and data["engine"]["spec_steps"] > 0
        assert data["engine"]["drafter"]["retrievals"] > 0
        assert data["engine"]["accepted_tokens"] > 0
    finally:
        await c.shutdown_session()
        await c.stop()


@ASYNC
async def test_workspace_folders_are_indexed_and_follow_changes(repo, tiny_model, tmp_path):
    """A multi-root workspace: the client's other folders are indexed beside the
    repository (snippets and drafts from their files on disk), a nested folder is not
    indexed twice, and workspace/didChangeWorkspaceFolders adds and removes folders; an
    open buffer of a removed folder still counts, through the repository's index."""
    from lsprotocol import types as T

    lib, tools = tmp_path / "lib", tmp_path / "tools"
    lib.mkdir()
    tools.mkdir()
    (repo / "sub").mkdir()
    (lib / "pricing.py").write_text("def compute_discount(order, percent):\n"
                                    "    return order.total * percent / 100\n")
    (tools / "invoice.py").write_text("def render_invoice(order):\n    return f'{order.id}: {order.total}'\n")
    c = await start_daemon(repo, tiny_model, extra_args=("--index-dir", str(tmp_path / "index")),
                           folders=[repo, lib, repo / "sub"])

    async def folders_ready(*roots):
        folders = (await stats(c))["folders"]
        return folders if [f["root"] for f in folders] == [str(r.resolve()) for r in roots] and all(
            f["ready"] and f.get("drafts") for f in folders) else None

    try:
        folders = await until(lambda: folders_ready(repo, lib))
        assert folders, (await stats(c))["folders"]
        assert folders[1]["files_indexed"] == 1 and folders[1]["db"] != folders[0]["db"]

        main = (repo / "main.py").as_uri()
        open_doc(c, main, "from pricing import compute_discount\n\nx = compute_discount(")
        r = await retrieve(c, main, 2, len("x = compute_discount("))
        assert [(s["path"], s["reason"]) for s in r["snippets"]][:1] == [
            ("lib/pricing.py", "definition of compute_discount")]
        probe = (repo / "probe.py").as_uri()
        open_doc(c, probe, "def compute_discount(order, percent):\n    return ")
        r = await retrieve(c, probe, 1, len("    return "))
        texts = [t["text"] for d in r["drafts"] if d["source"] == "repository" for t in d["continuations"]]
        assert any(t.startswith("order.total") for t in texts), texts

        # an unsaved buffer in lib, then lib leaves and tools joins
        scratch = (lib / "scratch.py").as_uri()
        open_doc(c, scratch, "def apply_coupon_code(cart, code):\n    return cart\n")
        c.workspace_did_change_workspace_folders(T.DidChangeWorkspaceFoldersParams(T.WorkspaceFoldersChangeEvent(
            added=[T.WorkspaceFolder(tools.as_uri(), "tools")], removed=[T.WorkspaceFolder(lib.as_uri(), "lib")])))
        assert await until(lambda: folders_ready(repo, tools)), (await stats(c))["folders"]

        open_doc(c, main, "from invoice import render_invoice\nfrom pricing import compute_discount\n"
                          "from scratch import apply_coupon_code\n\nx = render_invoice(compute_discount(", version=2)
        r = await retrieve(c, main, 4, len("x = render_invoice(compute_discount("))
        found = [s["path"] for s in r["snippets"]]
        assert "tools/invoice.py" in found and "lib/pricing.py" not in found, found
        open_doc(c, main, "from scratch import apply_coupon_code\n\ny = apply_coupon_code(", version=3)

        async def moved():
            r = await retrieve(c, main, 2, len("y = apply_coupon_code("))
            return [s["reason"] for s in r["snippets"]][:1] == ["definition of apply_coupon_code"]

        assert await until(moved, timeout=10)
    finally:
        await c.shutdown_session()
        await c.stop()


@ASYNC
async def test_the_editor_watches_files_for_the_index(repo, tiny_model, tmp_path):
    """A client that can register watchers is asked to report file changes
    (workspace/didChangeWatchedFiles) beside the daemon's own watcher, which inotify does
    not serve everywhere (WSL's /mnt drives, network file systems).  Its reports reach the
    index of the folder holding each file; others (outside every folder, .git, other
    schemes) are dropped."""
    from lsprotocol import types as T

    registrations: list = []
    c = await start_daemon(repo, tiny_model, extra_args=("--index-dir", str(tmp_path / "index")),
                           registrations=registrations)
    try:
        await until(lambda: _ready(c))
        assert [(r.method, [w["globPattern"] for w in r.register_options["watchers"]]) for r in registrations] == [
            ("workspace/didChangeWatchedFiles", ["**/*"])]
        (repo / "told.py").write_text("def reported_by_the_editor(x):\n    return x\n")
        (repo / ".git").mkdir()
        (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        changes = [T.FileEvent(uri=(repo / "told.py").as_uri(), type=T.FileChangeType.Created),
                   T.FileEvent(uri=(repo / ".git" / "HEAD").as_uri(), type=T.FileChangeType.Changed),
                   T.FileEvent(uri=(tmp_path / "elsewhere.py").as_uri(), type=T.FileChangeType.Created),
                   T.FileEvent(uri="untitled:Untitled-1", type=T.FileChangeType.Changed)]
        c.workspace_did_change_watched_files(T.DidChangeWatchedFilesParams(changes=changes))
        main = (repo / "main.py").as_uri()
        open_doc(c, main, "from told import reported_by_the_editor\n\nreported_by_the_editor(")

        async def found():
            r = await retrieve(c, main, 2, len("reported_by_the_editor("))
            return [s["reason"] for s in r["snippets"]][:1] == ["definition of reported_by_the_editor"]

        assert await until(found)
        assert (await stats(c))["index"]["client_events"] == 1
    finally:
        await c.shutdown_session()
        await c.stop()


@ASYNC
async def test_a_client_without_dynamic_watchers_is_not_asked(client):
    assert (await stats(client))["index"]["client_events"] == 0  # and no request it cannot answer


@ASYNC
async def test_an_index_damaged_under_the_daemon_is_rebuilt_and_keeps_following_files(client, repo, tmp_path):
    """A disk error or another program scribbles over the index while the daemon runs: the
    daemon keeps answering, moves the file aside, rebuilds it and follows saved files again."""
    import os
    import sqlite3

    assert await until(lambda: _ready(client))
    db = tmp_path / "index" / "index.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(db.read_bytes())
    for off in range(4096, len(data), 1024):
        data[off:off + 200] = os.urandom(len(data[off:off + 200]))
    db.write_bytes(bytes(data))

    (repo / "shipping.py").write_text("def compute_shipping_cost(order, region):\n    return order.weight\n")
    main = (repo / "main.py").as_uri()
    text = "from shipping import compute_shipping_cost\n\ntotal = compute_shipping_cost("
    open_doc(client, main, text)

    async def found():
        r = await retrieve(client, main, 2, len(text.splitlines()[-1]))
        return r if any(s["path"] == "shipping.py" for s in r["snippets"]) else None

    assert await until(found)
    index = (await stats(client))["index"]
    assert index["rebuilds"] == 1 and index["rebuilt_from"]
    assert list((tmp_path / "index").glob("index.sqlite.corrupt-*"))


@ASYNC
async def test_an_open_notebook_stands_for_its_file_in_the_index(client, repo):
    """A notebook on disk is indexed as its code cells; opened in the editor (notebookDocument/*),
    its cells' code stands for the file as an open buffer does, follows cell edits, and the
    file's own code is back once it closes."""
    from lsprotocol import types as T

    (repo / "analysis.ipynb").write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": ["def load_archived_ledger(path):\n", "    return open(path).read()\n"]}]}))
    assert await until(lambda: _ready(client))
    main = (repo / "main.py").as_uri()
    open_doc(client, main, "a = load_archived_ledger(\nb = summarize_quarterly_revenue(\n")

    async def defined(line: int, name: str):
        r = await retrieve(client, main, line, len(name) + 5)
        return [s["path"] for s in r["snippets"] if s["reason"] == f"definition of {name}"]

    assert await until(lambda: defined(0, "load_archived_ledger")) == ["analysis.ipynb"]
    nb = (repo / "analysis.ipynb").as_uri()
    cells = ["vscode-notebook-cell:" + (repo / "analysis.ipynb").as_posix() + f"#W{i}sZmlsZQ%3D%3D" for i in range(2)]
    code = "def summarize_quarterly_revenue(frame, quarter):\n    return frame[frame.q == quarter].sum()\n"
    client.notebook_document_did_open(T.DidOpenNotebookDocumentParams(
        notebook_document=T.NotebookDocument(uri=nb, notebook_type="jupyter-notebook", version=1, cells=[
            T.NotebookCell(kind=T.NotebookCellKind.Markup, document=cells[0]),
            T.NotebookCell(kind=T.NotebookCellKind.Code, document=cells[1])]),
        cell_text_documents=[T.TextDocumentItem(uri=cells[0], language_id="markdown", version=1, text="# Revenue"),
                             T.TextDocumentItem(uri=cells[1], language_id="python", version=1, text=code)]))
    assert await until(lambda: defined(1, "summarize_quarterly_revenue")) == ["analysis.ipynb"]
    assert await defined(0, "load_archived_ledger") == []  # the open notebook's cells, not its file
    end = T.Position(2, 0)
    client.notebook_document_did_change(T.DidChangeNotebookDocumentParams(
        notebook_document=T.VersionedNotebookDocumentIdentifier(version=2, uri=nb),
        change=T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(text_content=[
            T.NotebookDocumentCellContentChanges(
                document=T.VersionedTextDocumentIdentifier(uri=cells[1], version=2),
                changes=[T.TextDocumentContentChangePartial(range=T.Range(end, end),
                                                            text="\ndef load_archived_ledger(path):\n    pass\n")])]))))
    assert await until(lambda: defined(0, "load_archived_ledger")) == ["analysis.ipynb"]
    client.notebook_document_did_close(T.DidCloseNotebookDocumentParams(
        notebook_document=T.NotebookDocumentIdentifier(nb), cell_text_documents=[T.TextDocumentIdentifier(u)
                                                                                  for u in cells]))

    async def gone():
        return await defined(1, "summarize_quarterly_revenue") == []

    assert await until(gone)
    assert await defined(0, "load_archived_ledger") == ["analysis.ipynb"]  # the file's own code
    s = await stats(client)
    assert s["counters"]["server_errors"] == 0
