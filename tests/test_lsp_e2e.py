"""End to end: the real daemon over stdio, a real LSP client (pytest-lsp), the tiny
real model.  Each test names the behaviour it guards."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
import pytest_asyncio
from lsprotocol import types as T
from pygls.exceptions import JsonRpcException

from codecomplete.model.api import CompletionRequest
from codecomplete.model.engine import Engine, EngineSettings

from .lsp_client import (WHOLE_COMPLETIONS, complete, inline_params, insert, menu, open_doc, send_raw, start_daemon,
                         stats)

pytestmark = pytest.mark.asyncio(loop_scope="function")

POINT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self."


@pytest.fixture(scope="module")
def reference_engine(tiny_model):
    """The same model in-process: what the daemon must answer for a given cursor."""
    engine = Engine(EngineSettings(model=str(tiny_model), dtype="float32")).start()
    yield engine
    engine.close()


def expected(engine: Engine, prefix: str, suffix: str, **kw) -> str:
    """The completion a new editing session gets (a fresh session key each call)."""
    return engine.complete(CompletionRequest(prefix, suffix, session_key=f"reference-{next(_KEYS)}", **kw)).text


_KEYS = itertools.count()


def proposed(items, typed: str) -> list[str]:
    """What each item adds at the cursor: items repeat the text typed on the line."""
    assert all(i.insert_text.startswith(typed) for i in items), [i.insert_text for i in items]
    return [i.insert_text[len(typed):] for i in items]

LAST = POINT.split("\n")[-1]  # "        self."


@pytest_asyncio.fixture
async def client(repo, tiny_model, model_cache):
    c = await start_daemon(repo, tiny_model)
    yield c
    await c.shutdown_session()
    await c.stop()


async def test_open_edit_request_gets_the_engines_completion(client, repo, reference_engine):
    """Guards the whole path: didOpen + incremental didChange + inlineCompletion."""
    uri = (repo / "point.py").as_uri()
    open_doc(client, uri, "class Point:\n")
    insert(client, uri, 2, 1, 0, POINT.split("\n", 1)[1])
    lines = POINT.split("\n")
    items = await complete(client, uri, len(lines) - 1, len(lines[-1]))
    want = expected(reference_engine, POINT, "")
    assert want.strip(), "the tiny model should complete this prompt"
    assert proposed(items, LAST) == [want]
    item = items[0]
    assert item.range.start == T.Position(len(lines) - 1, 0)
    assert item.range.end == T.Position(len(lines) - 1, len(lines[-1]))
    assert item.command.command == "codecomplete.accept"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8"])
async def test_emoji_before_cursor_is_converted_in_the_negotiated_encoding(
        encoding, repo, tiny_model, model_cache, reference_engine):
    """Guards position conversion: a character outside the BMP before the cursor."""
    # a token budget, not the time budget, ends these completions (the tiny model rambles)
    budget = {"maxTokens": 16, "timeBudgetMs": 60000}
    c = await start_daemon(repo, tiny_model, encodings=[encoding], init_options={"codecomplete": {"completion": budget}})
    try:
        assert c.capabilities is not None
        line = 'label = "😀 ok"  # 😀\n' + POINT
        uri = (repo / "emoji.py").as_uri()
        open_doc(c, uri, line)
        last = line.split("\n")[-1]
        row = line.count("\n")
        items = await complete(c, uri, row, len(last))  # last line is ASCII: same in all units
        want = expected(reference_engine, line, "", max_tokens=16, time_budget_ms=60000)
        assert proposed(items, LAST) == [want]
        # A cursor right after the emoji on line 0: its column differs per encoding.
        col = {"utf-16": len('label = "') + 2, "utf-8": len('label = "') + 4}[encoding]
        items = await complete(c, uri, 0, col)
        want = expected(reference_engine, 'label = "😀', ' ok"  # 😀\n' + POINT, max_tokens=16, time_budget_ms=60000)
        assert proposed(items, 'label = "😀') == ([want] if want.strip() else [])
        for i in items:
            assert i.range.start == T.Position(0, 0)
            first = line.split("\n")[0]
            width = len(first.encode("utf-16-le")) // 2 if encoding == "utf-16" else len(first.encode())
            assert i.range.end.character in (col, width)  # the cursor, or the line's end
        s = await stats(c)
        assert s["position_encoding"] == encoding
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_newer_request_supersedes_older(repo, tiny_model, model_cache, reference_engine):
    """Guards superseding: the older request answers empty, the newer one answers."""
    c = await start_daemon(repo, tiny_model, init_options={"completion": {"debounceMs": 400}})
    try:
        uri = (repo / "p.py").as_uri()
        open_doc(c, uri, POINT)
        lines = POINT.split("\n")
        older = c.text_document_inline_completion_async(inline_params(uri, 3, len(lines[3]), invoked=False))
        older_task = asyncio.ensure_future(older)
        await asyncio.sleep(0.05)
        newer = await complete(c, uri, 3, len(lines[3]))
        assert list((await older_task).items) == []
        assert proposed(newer, LAST) == [expected(reference_engine, POINT, "")]
        s = await stats(c)
        assert s["counters"]["superseded"] == 1
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_cancel_request_answers_cancelled_and_next_is_served(repo, tiny_model, model_cache,
                                                                  reference_engine):
    """Guards $/cancelRequest: RequestCancelled for that id, and the server goes on."""
    c = await start_daemon(repo, tiny_model, init_options={"completion": {"debounceMs": 1000}})
    try:
        uri = (repo / "p.py").as_uri()
        open_doc(c, uri, POINT)
        fut = c.protocol.send_request("textDocument/inlineCompletion",
                                      inline_params(uri, 3, 13, invoked=False), msg_id="cancel-me")
        await asyncio.sleep(0.1)
        c.protocol.notify("$/cancelRequest", T.CancelParams(id="cancel-me"))
        with pytest.raises(JsonRpcException) as err:
            await asyncio.wrap_future(fut)
        assert err.value.code == -32800  # RequestCancelled
        items = await complete(c, uri, 3, 13)
        assert proposed(items, LAST) == [expected(reference_engine, POINT, "")]
        s = await stats(c)
        assert s["counters"]["cancelled"] == 1
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_bad_input_gets_errors_and_the_daemon_keeps_serving(client, repo, reference_engine):
    """Guards robustness: each bad request gets an error or an empty result."""
    uri = (repo / "ok.py").as_uri()
    open_doc(client, uri, POINT)
    want = [expected(reference_engine, POINT, "")]

    async def still_serving():
        items = await complete(client, uri, 3, 13)
        assert proposed(items, LAST) == want

    # A position past the end of the document.
    with pytest.raises(JsonRpcException) as err:
        await complete(client, uri, 99, 0)
    assert "past the end" in str(err.value)
    await still_serving()
    # A document that is neither open nor on disk.
    with pytest.raises(JsonRpcException):
        await complete(client, (repo / "missing.py").as_uri(), 0, 0)
    await still_serving()
    # Edits of a document the client never opened: ignored, not turned into a buffer.
    never = (repo / "never_opened.py").as_uri()
    errors = (await stats(client))["counters"]["server_errors"]
    client.text_document_did_change(T.DidChangeTextDocumentParams(
        text_document=T.VersionedTextDocumentIdentifier(uri=never, version=2),
        content_changes=[T.TextDocumentContentChangePartial(
            range=T.Range(T.Position(0, 0), T.Position(0, 0)), text="import os\n")]))
    await still_serving()
    assert (await stats(client))["counters"]["server_errors"] == errors  # logged as a warning, no failure
    with pytest.raises(JsonRpcException) as err:
        await complete(client, never, 0, 0)
    assert "does not exist" in str(err.value)
    await still_serving()
    # A file on disk that is not UTF-8.
    with pytest.raises(JsonRpcException) as err:
        await complete(client, (repo / "latin1.py").as_uri(), 1, 0)
    assert "UTF-8" in str(err.value)
    await still_serving()
    # A 10 MB document: served with an empty result, not a 10 MB prompt.
    big = (repo / "big.py").as_uri()
    open_doc(client, big, "x = 1\n" * (10_000_000 // 6) + "y = ")
    assert await complete(client, big, 10_000_000 // 6, 4) == []
    await still_serving()
    # A body that is not JSON, then params that do not fit the method.
    await send_raw(client, b"{this is not json")
    await still_serving()
    bad = {"jsonrpc": "2.0", "id": "bad-params", "method": "textDocument/inlineCompletion",
           "params": {"textDocument": {"uri": uri}, "position": "nowhere"}}
    with pytest.raises(JsonRpcException) as err:
        await send_raw(client, json.dumps(bad).encode(), msg_id="bad-params")
    assert err.value.code == -32602  # InvalidParams
    await still_serving()
    s = await stats(client)
    assert s["counters"]["completions"] >= 6


WORD = "import sys\n\ndef main():\n    print(sys.argv)\n"
WORD_AT = (3, 7)  # "    pri|nt(sys.argv)"


async def test_typing_inside_a_word_gets_nothing_and_an_invoked_request_is_answered(client, repo, reference_engine):
    """Guards the inside-word rule: a request made while typing with the cursor between two
    identifier characters gets no completion (text inserted there splits the word: the model
    tends to write a new line from ``pri`` and leave ``nt(sys.argv)`` after it), counted as
    ``inside_word``; one the user invoked there is answered; the word's end is answered; with
    ``completion.inside_word`` on, a request while typing there is answered too."""
    uri = (repo / "word.py").as_uri()
    open_doc(client, uri, WORD)
    assert await complete(client, uri, *WORD_AT) == []
    assert (await stats(client))["counters"]["inside_word"] == 1
    cut = WORD.index("nt(sys")
    want = expected_all(reference_engine, WORD[:cut], WORD[cut:], 3)
    assert proposed(await complete(client, uri, *WORD_AT, invoked=True), "    pri") == want
    end = WORD.index("(sys")  # "    print|(sys.argv)": after the word
    want = expected(reference_engine, WORD[:end], WORD[end:])
    assert want.strip(), "the tiny model should complete this prompt"
    assert proposed(await complete(client, uri, 3, 9), "    print") == [want]
    assert (await stats(client))["counters"]["inside_word"] == 1
    # completion.inside_word: answered while typing too (the greedy completion alone)
    client.workspace_did_change_configuration(T.DidChangeConfigurationParams(
        settings={"codecomplete": {"completion": {"insideWord": True}}}))
    cut_want = expected_all(reference_engine, WORD[:cut], WORD[cut:], 3)[:1]
    assert proposed(await complete(client, uri, *WORD_AT), "    pri") == cut_want
    assert (await stats(client))["counters"]["inside_word"] == 1


async def test_buffers_are_found_under_the_uris_clients_send(client, repo, reference_engine):
    """Guards uri handling: VS Code percent-encodes paths (``my%20dir``, ``c%3A``) and pygls
    keys buffers by the decoded uri; the open buffer is completed, not the file on disk,
    also for a notebook cell and an unsaved buffer."""
    folder = repo / "my dir"
    folder.mkdir()
    (folder / "a b.py").write_text("x = 1\n")  # on disk: another text, one line
    want = [expected(reference_engine, POINT, "")]
    uri = (folder / "a b.py").as_uri()
    assert "%20" in uri
    open_doc(client, uri, POINT)
    assert proposed(await complete(client, uri, 3, 13), LAST) == want
    unsaved = (folder / "not saved.py").as_uri()
    open_doc(client, unsaved, POINT)
    assert proposed(await complete(client, unsaved, 3, 13), LAST) == want
    cell = "vscode-notebook-cell:" + (folder / "nb.ipynb").as_posix() + "#W0sZmlsZQ%3D%3D"
    open_doc(client, cell, POINT)
    assert proposed(await complete(client, cell, 3, 13), LAST) == want
    client.text_document_did_close(T.DidCloseTextDocumentParams(T.TextDocumentIdentifier(unsaved)))
    with pytest.raises(JsonRpcException):
        await complete(client, unsaved, 3, 13)


async def test_a_notebook_cell_is_completed_with_the_code_cells_around_it(client, repo, reference_engine):
    """Notebooks synced as notebooks (notebookDocument/*, as VS Code does for Jupyter once
    the server offers it): a cell's prompt holds the code cells before it and after it, in
    the notebook's order; markdown cells and cells of another language are left out; cell
    edits and a new cell order apply."""
    sync = client.initialized_with.capabilities.notebook_document_sync  # to clients that sync notebooks
    assert sync is not None and sync.notebook_selector[0].notebook == "*"
    nb = (repo / "analysis.ipynb").as_uri()
    cell = ["vscode-notebook-cell:" + (repo / "analysis.ipynb").as_posix() + f"#W{i}sZmlsZQ%3D%3D" for i in range(5)]
    texts = [POINT.rsplit("\n", 1)[0] + "\n", "# Points", "%%bash\nls", "p = Point(1, 2)\np.", "print(p)\n"]
    kinds = [T.NotebookCellKind.Code, T.NotebookCellKind.Markup, T.NotebookCellKind.Code, T.NotebookCellKind.Code,
             T.NotebookCellKind.Code]
    languages = ["python", "markdown", "shellscript", "python", "python"]
    client.notebook_document_did_open(T.DidOpenNotebookDocumentParams(
        notebook_document=T.NotebookDocument(uri=nb, notebook_type="jupyter-notebook", version=1, cells=[
            T.NotebookCell(kind=k, document=u) for k, u in zip(kinds, cell)]),
        cell_text_documents=[T.TextDocumentItem(uri=u, language_id=lang, version=1, text=t)
                             for u, lang, t in zip(cell, languages, texts)]))
    alone = expected(reference_engine, texts[3], "")
    want = expected(reference_engine, texts[0].rstrip("\n") + "\n\n" + texts[3], "\n\n" + texts[4].rstrip("\n"))
    assert want != alone, "the context should change the tiny model's completion"
    assert proposed(await complete(client, cell[3], 1, 2), "p.") == [want]

    # an edit to a cell (notebookDocument/didChange), then the last cell moved to the top
    client.notebook_document_did_change(T.DidChangeNotebookDocumentParams(
        notebook_document=T.VersionedNotebookDocumentIdentifier(version=2, uri=nb),
        change=T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(text_content=[
            T.NotebookDocumentCellContentChanges(
                document=T.VersionedTextDocumentIdentifier(uri=cell[4], version=2),
                changes=[T.TextDocumentContentChangePartial(range=T.Range(T.Position(0, 0), T.Position(0, 0)),
                                                            text="q = 3\n")])]))))
    client.notebook_document_did_change(T.DidChangeNotebookDocumentParams(
        notebook_document=T.VersionedNotebookDocumentIdentifier(version=3, uri=nb),
        change=T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(
            structure=T.NotebookDocumentCellChangeStructure(
                array=T.NotebookCellArrayChange(start=4, delete_count=1))))))
    client.notebook_document_did_change(T.DidChangeNotebookDocumentParams(
        notebook_document=T.VersionedNotebookDocumentIdentifier(version=4, uri=nb),
        change=T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(
            structure=T.NotebookDocumentCellChangeStructure(array=T.NotebookCellArrayChange(
                start=0, delete_count=0, cells=[T.NotebookCell(T.NotebookCellKind.Code, cell[4])]))))))
    moved = expected(reference_engine, "q = 3\nprint(p)\n\n" + texts[0].rstrip("\n") + "\n\n" + texts[3], "")
    assert proposed(await complete(client, cell[3], 1, 2), "p.") == [moved]
    client.notebook_document_did_close(T.DidCloseNotebookDocumentParams(
        notebook_document=T.NotebookDocumentIdentifier(nb),
        cell_text_documents=[T.TextDocumentIdentifier(u) for u in cell]))
    with pytest.raises(JsonRpcException):
        await complete(client, cell[3], 1, 2)


async def test_a_lone_surrogate_in_a_buffer_is_read_as_a_replacement_character(client, repo, reference_engine):
    """Guards text from JSON: ``"\\ud800"`` decodes to an unpaired surrogate, which no
    tokenizer takes; it is completed as U+FFFD (one UTF-16 unit, so positions hold)."""
    uri = (repo / "surrogate.py").as_uri()
    head = "s = '\ud800'\n"
    body = {"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": uri, "languageId": "python", "version": 1, "text": head + POINT}}}
    await send_raw(client, json.dumps(body).encode())  # json.dumps writes it as \ud800
    items = await complete(client, uri, 4, 13)
    assert proposed(items, LAST) == [expected(reference_engine, head.replace("\ud800", "\ufffd") + POINT, "")]
    s = await stats(client)
    assert s["counters"]["errors"] == 0, s["counters"]


async def test_invalid_params_are_logged_as_one_line_that_says_why(repo, tiny_model, model_cache, tmp_path):
    """Guards the log of a malformed request: one warning naming the field that is wrong (a
    negative line), not pygls's ERROR with a traceback (kept for -vv); the request is answered
    InvalidParams and the daemon serves on."""
    log_file = tmp_path / "daemon.log"
    client = await start_daemon(repo, tiny_model, extra_args=("--log-file", str(log_file)))
    uri = (repo / "ok.py").as_uri()
    open_doc(client, uri, POINT)
    bad = {"jsonrpc": "2.0", "id": "neg", "method": "textDocument/inlineCompletion",
           "params": {"textDocument": {"uri": uri}, "position": {"line": -1, "character": 0},
                      "context": {"triggerKind": 1}}}
    with pytest.raises(JsonRpcException) as err:
        await asyncio.wait_for(send_raw(client, json.dumps(bad).encode(), msg_id="neg"), 30)
    assert err.value.code == -32602  # InvalidParams
    assert await complete(client, uri, 3, 13)
    await client.shutdown_session()
    await client.stop()
    text = log_file.read_text()
    warned = [ln for ln in text.splitlines() if "invalid params for textDocument/inlineCompletion (id neg)" in ln]
    assert len(warned) == 1 and "Position.line" in warned[0] and "-1" in warned[0], text[-2000:]
    assert "Unable to deserialize" not in text and "Traceback" not in text, text[-2000:]


async def test_a_request_after_shutdown_is_answered_invalid_request(repo, tiny_model, model_cache):
    """Guards the LSP rule: after ``shutdown`` a request errors with InvalidRequest
    (pygls would drop it and the client would wait forever); ``exit`` still ends the
    daemon, with status 0."""
    client = await start_daemon(repo, tiny_model)
    await client.shutdown_async(None)
    bad = {"jsonrpc": "2.0", "id": "late", "method": "textDocument/inlineCompletion",
           "params": {"textDocument": {"uri": (repo / "ok.py").as_uri()}, "position": {"line": 0, "character": 0},
                      "context": {"triggerKind": 1}}}
    with pytest.raises(JsonRpcException) as err:
        await asyncio.wait_for(send_raw(client, json.dumps(bad).encode(), msg_id="late"), 30)
    assert err.value.code == -32600  # InvalidRequest
    client.exit(None)
    assert await asyncio.wait_for(client._server.wait(), 30) == 0
    await client.stop()


async def test_before_initialize_a_request_is_answered_server_not_initialized(repo, tiny_model, model_cache,
                                                                               reference_engine):
    """Guards the LSP rule: before ``initialize`` a request errors with ServerNotInitialized
    (-32002) and a notification is dropped; the daemon then initializes and serves as usual."""
    import sys

    from pytest_lsp import make_test_lsp_client

    client = make_test_lsp_client()
    await client.start_io(sys.executable, "-m", "codecomplete.daemon", "--repo", str(repo),
                          "--model", str(tiny_model), "--dtype", "float32", *WHOLE_COMPLETIONS)
    uri = (repo / "early.py").as_uri()
    body = {"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": uri, "languageId": "python", "version": 1, "text": POINT}}}
    await send_raw(client, json.dumps(body).encode())  # dropped: no document is opened by it
    early = {"jsonrpc": "2.0", "id": "early", "method": "textDocument/inlineCompletion",
             "params": {"textDocument": {"uri": uri}, "position": {"line": 3, "character": 13},
                        "context": {"triggerKind": 1}}}
    with pytest.raises(JsonRpcException) as err:
        await asyncio.wait_for(send_raw(client, json.dumps(early).encode(), msg_id="early"), 60)
    assert err.value.code == -32002  # ServerNotInitialized
    await client.initialize_session(T.InitializeParams(capabilities=T.ClientCapabilities(), root_uri=repo.as_uri()))
    with pytest.raises(JsonRpcException):  # the early didOpen was not applied: unknown document
        await complete(client, uri, 3, 13)
    open_doc(client, uri, POINT)
    items = await complete(client, uri, 3, 13, invoked=True)
    assert proposed(items, LAST)[0] == expected(reference_engine, POINT, "")
    await client.shutdown_session()


async def test_an_item_on_a_very_long_line_repeats_only_the_word(client, repo, reference_engine):
    """Guards minified code: on a line typed past 1,000 characters the item's range starts
    at the word being typed, not the line's start, so an answer does not resend the line."""
    line = "data = [" + ", ".join(str(i) for i in range(1500)) + ", val"
    uri = (repo / "long_line.py").as_uri()
    open_doc(client, uri, line)
    items = await complete(client, uri, 0, len(line))
    assert len(items) == 1
    item = items[0]
    assert item.range.start == T.Position(0, len(line) - 3) and item.range.end == T.Position(0, len(line))
    assert item.insert_text == "val" + expected(reference_engine, line, "")


@pytest.mark.parametrize("root", ["workspace_folders", "root_path", "not_a_file_uri"])
async def test_the_repository_comes_from_the_clients_workspace_without_root_uri(repo, tiny_model, model_cache, root):
    """Guards clients that send no rootUri (deprecated in LSP 3.17): the first file
    workspace folder, else rootPath, is indexed; a root that is not a file uri indexes
    nothing (not the daemon's working directory)."""
    import sys

    from pytest_lsp import make_test_lsp_client

    client = make_test_lsp_client()
    await client.start_io(sys.executable, "-m", "codecomplete.daemon", "--model", str(tiny_model),
                          "--dtype", "float32", *WHOLE_COMPLETIONS, cwd=str(repo.parent))
    params = {
        "workspace_folders": dict(workspace_folders=[
            T.WorkspaceFolder(uri="vscode-vfs://github/x/y", name="remote"),
            T.WorkspaceFolder(uri=repo.as_uri(), name="repo")]),
        "root_path": dict(root_path=str(repo)),
        "not_a_file_uri": dict(root_uri="vscode-vfs://github/x/y"),
    }[root]
    await client.initialize_session(T.InitializeParams(capabilities=T.ClientCapabilities(), **params))
    try:
        index = (await stats(client))["index"]
        if root == "not_a_file_uri":
            assert index is None
        else:
            assert index["root"] == str(repo.resolve())
    finally:
        await client.shutdown_session()
        await client.stop()


async def test_edits_below_a_form_feed_land_on_the_lines_the_client_means(client, repo, reference_engine):
    """Guards LSP's line breaks (\\n, \\r\\n, \\r only): pygls split lines at form feeds
    and U+2028 too, so every edit below one landed a line off and the daemon's buffer
    drifted from the editor's."""
    head = "# page one\x0c page two, s = '\u2028'\n"
    uri = (repo / "formfeed.py").as_uri()
    open_doc(client, uri, head + POINT)
    row = (head + POINT).count("\n")  # the cursor's line, as the client counts
    insert(client, uri, 2, row, len(LAST), "x")
    insert(client, uri, 3, row, len(LAST) + 1, "_")
    items = await complete(client, uri, row, len(LAST) + 2)
    assert proposed(items, LAST + "x_") == [expected(reference_engine, head + POINT + "x_", "")]


async def test_close_frees_the_document(client, repo):
    """Guards didClose: the document is gone from the server afterwards."""
    uri = (repo / "scratch.py").as_uri()  # not on disk: only the open buffer knows it
    open_doc(client, uri, POINT)
    assert await complete(client, uri, 3, 13)
    client.text_document_did_close(T.DidCloseTextDocumentParams(T.TextDocumentIdentifier(uri)))
    with pytest.raises(JsonRpcException):
        await complete(client, uri, 3, 13)
    s = await stats(client)
    assert s["open_documents"] == 0
    assert s["position_encoding"] == "utf-16"  # a client that offers none gets LSP's default


async def test_completions_are_off_in_disabled_languages_and_paths(repo, tiny_model, model_cache):
    """completion.disabled_languages / disabled_paths: no model run there (the language
    the editor sends, or the file name's; patterns relative to the workspace folder), the
    other files are served, and a settings change turns them back on."""
    c = await start_daemon(repo, tiny_model, init_options={"completion": {
        "disabledLanguages": ["Markdown"], "disabledPaths": [".env", "secrets/**", "scratch/*.ipynb"]}})
    try:
        cell = "vscode-notebook-cell:" + (repo / "scratch" / "nb.ipynb").as_posix() + "#W0sZmlsZQ%3D%3D"
        docs = {"notes.md": "plaintext", "notes.txt": "markdown", ".env": "python", "secrets/key.py": "python",
                "app/.env": "python", "tmp/ok.py": "python", cell: "python"}

        def uri_of(name: str) -> str:
            return name if ":" in name else (repo / name).as_uri()

        for name, language in docs.items():
            open_doc(c, uri_of(name), POINT, language=language)
        served = {}
        for name in docs:
            before = (await stats(c))["engine"]["completions"]
            items = await complete(c, uri_of(name), 3, 13)
            served[name] = (await stats(c))["engine"]["completions"] > before
            assert bool(items) == served[name], name
        assert served == {"notes.md": False, "notes.txt": False, ".env": False, "secrets/key.py": False,
                          "app/.env": False, "tmp/ok.py": True, cell: False}  # a cell: its notebook's path
        assert (await stats(c))["counters"]["disabled"] == 6
        c.workspace_did_change_configuration(T.DidChangeConfigurationParams(
            settings={"codecomplete": {"completion": {"disabledLanguages": [], "disabledPaths": "secrets/**"}}}))
        assert await complete(c, (repo / "notes.md").as_uri(), 3, 13)
        assert await complete(c, (repo / ".env").as_uri(), 3, 13)
        assert not await complete(c, (repo / "secrets/key.py").as_uri(), 3, 13)
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_a_set_flag_wins_over_the_editors_settings_and_their_changes(repo, tiny_model, model_cache):
    """Guards the daemon's --set: a setting named on its command line holds against the editor's
    initializationOptions and a later workspace/didChangeConfiguration (those change the others);
    codecomplete/stats with {"config": true} shows the settings in force."""
    c = await start_daemon(repo, tiny_model, init_options={"completion": {"disabledLanguages": []}},
                           extra_args=("--set", 'completion.disabled_languages=["markdown"]'))
    try:
        for name, language in (("a.py", "python"), ("b.md", "markdown")):
            open_doc(c, (repo / name).as_uri(), POINT, language=language)
        assert await complete(c, (repo / "a.py").as_uri(), 3, 13)
        assert not await complete(c, (repo / "b.md").as_uri(), 3, 13)
        c.workspace_did_change_configuration(T.DidChangeConfigurationParams(settings={"codecomplete": {
            "completion": {"disabledLanguages": [], "disabledPaths": ["a.py"]}}}))
        assert not await complete(c, (repo / "b.md").as_uri(), 3, 13)
        assert not await complete(c, (repo / "a.py").as_uri(), 3, 13)  # the editor's change applies to the rest
        s = await stats(c, config=True)
        assert s["counters"]["disabled"] == 3
        # the settings in force, as codecomplete/stats {"config": true} shows them
        assert s["config"]["completion"]["disabled_languages"] == ["markdown"]
        assert s["config"]["completion"]["disabled_paths"] == ["a.py"]
        assert s["config"]["completion"]["first_lines_ms"] == 0  # start_daemon's own --set
        assert "config" not in await stats(c)
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_telemetry_counts_shown_accepted_rejected(client, repo):
    """Guards the acceptance counters, ours and Copilot-shaped."""
    uri = (repo / "t.py").as_uri()
    open_doc(client, uri, POINT)
    items = await complete(client, uri, 3, 13)
    assert items
    cid = items[0].command.arguments[0]["completionId"]
    item = json.loads(json.dumps(client.protocol._converter.unstructure(items[0])))
    client.protocol.notify("textDocument/didShowCompletion", {"item": item})
    client.protocol.notify("codecomplete/didRejectCompletion", {"completionId": cid})
    client.protocol.notify("textDocument/didPartiallyAcceptCompletion", {"item": item, "acceptedLength": 3})
    await client.workspace_execute_command_async(T.ExecuteCommandParams(
        command=items[0].command.command, arguments=items[0].command.arguments))
    s = await stats(client)
    counters = s["counters"]
    assert (counters["shown"], counters["accepted"], counters["rejected"],
            counters["partially_accepted"]) == (1, 1, 1, 1)
    assert counters["latency_ms"]["n"] >= 1


async def test_selected_menu_item_is_continued(client, repo, reference_engine):
    """Guards VS Code's selectedCompletionInfo: while its suggest widget has an item
    selected, the inline completion must extend that item's text over its range (the
    editor shows the ghost text only then); an item that is not on the cursor's line is
    ignored."""
    uri = (repo / "sel.py").as_uri()
    text = POINT + "x"  # "        self.x", the menu offers "x_coord" for the word "x"
    open_doc(client, uri, text)
    lines = text.split("\n")
    line, col = len(lines) - 1, len(lines[-1])
    want = expected(reference_engine, POINT + "x_coord", "")
    assert want.strip(), "the tiny model should complete this prompt"
    selected = T.SelectedCompletionInfo(range=T.Range(T.Position(line, col - 1), T.Position(line, col)),
                                        text="x_coord")
    params = inline_params(uri, line, col)
    params.context.selected_completion_info = selected
    result = await client.text_document_inline_completion_async(params)
    [item] = result.items
    # the selected item's range, its text, then the completion
    assert item.insert_text == "x_coord" + want
    assert item.range == selected.range
    # a selected item on another line cannot be continued here: it is ignored
    params.context.selected_completion_info = T.SelectedCompletionInfo(
        range=T.Range(T.Position(0, 0), T.Position(0, 5)), text="class")
    [item] = (await client.text_document_inline_completion_async(params)).items
    assert item.insert_text == lines[-1] + expected(reference_engine, text, "")


async def test_clients_without_inline_completions_get_a_menu_item(repo, tiny_model, model_cache, reference_engine):
    """Guards textDocument/completion: a client that has only the completion menu gets the
    same completion as one item that replaces the word being typed (so the menu's filter
    keeps it) and is inserted as is; a client with inline completions gets no menu item
    unless it asks for them (completion.lsp_completion)."""
    prefix = POINT + "x"  # "        self.x": the word "x" is being typed
    lines = prefix.split("\n")
    want = expected(reference_engine, prefix, "")
    assert want.strip(), "the tiny model should complete this prompt"
    menu_only = await start_daemon(repo, tiny_model, inline=False)
    try:
        uri = (repo / "m.py").as_uri()
        open_doc(menu_only, uri, prefix)
        result = await menu(menu_only, uri, len(lines) - 1, len(lines[-1]))
        assert result.is_incomplete  # the answer changes with every keystroke: ask again
        [item] = result.items
        assert item.text_edit.new_text == "x" + want
        assert item.text_edit.range == T.Range(T.Position(len(lines) - 1, len(lines[-1]) - 1),
                                               T.Position(len(lines) - 1, len(lines[-1])))
        assert item.filter_text == item.text_edit.new_text and item.filter_text.startswith("x")
        assert item.label == ("x" + want).split("\n")[0].strip()[:80] or item.label.endswith("\u2026")
        assert item.insert_text_mode == T.InsertTextMode.AsIs
        assert item.command.command == "codecomplete.accept"
        assert item.documentation == "x" + want  # plain text: this client did not offer markdown
        # out of range is an error, as for inline requests, and the daemon keeps serving
        with pytest.raises(JsonRpcException):
            await menu(menu_only, uri, 99, 0)
        assert (await menu(menu_only, uri, len(lines) - 1, len(lines[-1]))).items
        # inside a word a menu request (asked while typing, "Invoked" or not) gets nothing
        word = (repo / "word.py").as_uri()
        open_doc(menu_only, word, WORD)
        inside = await menu(menu_only, word, *WORD_AT)
        assert inside.is_incomplete and not inside.items
        assert (await stats(menu_only))["counters"]["inside_word"] == 1
    finally:
        await menu_only.shutdown_session()
        await menu_only.stop()
    both = await start_daemon(repo, tiny_model, markdown=True)  # announces inline completions
    try:
        uri = (repo / "m.py").as_uri()
        open_doc(both, uri, prefix)
        assert not (await menu(both, uri, len(lines) - 1, len(lines[-1]))).items
        assert proposed(await complete(both, uri, len(lines) - 1, len(lines[-1])), lines[-1]) == [want]
        both.workspace_did_change_configuration(T.DidChangeConfigurationParams(
            settings={"codecomplete": {"completion": {"lspCompletion": "always"}}}))
        [item] = (await menu(both, uri, len(lines) - 1, len(lines[-1]))).items
        assert item.text_edit.new_text == "x" + want
        assert item.documentation.kind == T.MarkupKind.Markdown
        assert item.documentation.value == f"```python\nx{want}\n```"
    finally:
        await both.shutdown_session()
        await both.stop()


async def model_progress(c, timeout_s: float) -> list:
    """The model's work-done progress reports, once it has ended (or ``timeout_s`` passed)."""
    for _ in range(int(timeout_s * 10)):
        reports = c.progress_reports.get("codecomplete/model", [])
        if reports and isinstance(reports[-1], T.WorkDoneProgressEnd):
            break
        await asyncio.sleep(0.1)
    return c.progress_reports["codecomplete/model"]


async def test_startup_progress_while_the_model_loads(repo, model_cache):
    """Guards work-done progress: a client that supports it sees the model load (the
    default model takes seconds) and the first index scan begin and end, with the end
    saying the model is ready; a client without the capability gets none.  A client slow
    to answer the daemon's file-watcher registration does not hold progress up."""
    registrations: list = []
    gate = asyncio.Event()
    c = await start_daemon(repo, "default", progress=True, registrations=registrations, registration_gate=gate)
    try:
        reports = await model_progress(c, 60)
        assert isinstance(reports[0], T.WorkDoneProgressBegin) and reports[0].title == "codecomplete: loading model"
        assert isinstance(reports[-1], T.WorkDoneProgressEnd) and "ready" in reports[-1].message
        assert not registrations  # still unanswered
        gate.set()
        for _ in range(100):
            if registrations:
                break
            await asyncio.sleep(0.1)
        assert registrations
        assert (await stats(c))["engine"]["ready"]
        index = c.progress_reports.get("codecomplete/index")
        if index:  # a small repository may be indexed before the client is initialized
            assert isinstance(index[0], T.WorkDoneProgressBegin)
            for _ in range(300):
                if isinstance(index[-1], T.WorkDoneProgressEnd):
                    break
                await asyncio.sleep(0.1)
            assert "files indexed" in index[-1].message
    finally:
        await c.shutdown_session()
        await c.stop()
    quiet = await start_daemon(repo, "default")
    try:
        for _ in range(600):
            if (await stats(quiet))["engine"]["ready"]:
                break
            await asyncio.sleep(0.1)
        assert quiet.progress_reports == {}
    finally:
        await quiet.shutdown_session()
        await quiet.stop()


async def test_a_first_start_says_what_it_prepares(repo, model_cache, tmp_path, monkeypatch):
    """A first start on an empty cache takes seconds more than later ones: the progress report
    says what they go to (converting the model, applying the fine-tune), then that it is ready."""
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("CODECOMPLETE_NATIVE_DIR", raising=False)
    c = await start_daemon(repo, "default", progress=True)
    try:
        reports = await model_progress(c, 120)
        said = [r.message for r in reports if isinstance(r, (T.WorkDoneProgressBegin, T.WorkDoneProgressReport))]
        assert "converting the model (once)" in said and "applying the fine-tune (once)" in said, said
        assert said.index("converting the model (once)") < said.index("applying the fine-tune (once)")
        assert isinstance(reports[-1], T.WorkDoneProgressEnd) and "ready" in reports[-1].message
        assert (await stats(c))["engine"]["loading"] is None
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_invalid_setting_falls_back_with_a_warning(repo, tiny_model, model_cache):
    """Guards typed config: a bad value is reported and replaced by its default."""
    c = await start_daemon(repo, tiny_model, init_options={
        "codecomplete": {"completion": {"mode": "sideways", "maxTokens": 8}}})
    try:
        uri = (repo / "w.py").as_uri()
        open_doc(c, uri, POINT)
        items = await complete(c, uri, 3, 13)
        assert items and len(items[0].insert_text) > len(LAST)
        warnings = [m.message for m in c.log_messages if m.type == T.MessageType.Warning]
        assert any("mode" in w and "sideways" in w for w in warnings), warnings
        c.workspace_did_change_configuration(T.DidChangeConfigurationParams(
            settings={"codecomplete": {"completion": {"enabled": False}}}))
        assert await complete(c, uri, 3, 13) == []
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_early_exit_serves_inline_completions(repo, tiny_model, tiny_exits, model_cache, reference_engine):
    """Guards early exit in the daemon: lossless mode answers exactly what the full model
    does; a lossy threshold every token meets leaves the stack early and still answers
    (with speculation off: beside it, early exit takes only the steps without drafts);
    the stats report both."""
    exits = {"enabled": True, "lossless": True, "path": str(tiny_exits)}
    c = await start_daemon(repo, tiny_model, init_options={"codecomplete": {"earlyExit": exits}})
    try:
        uri = (repo / "ee.py").as_uri()
        open_doc(c, uri, POINT)
        lines = POINT.split("\n")
        items = await complete(c, uri, len(lines) - 1, len(lines[-1]))
        assert proposed(items, LAST) == [expected(reference_engine, POINT, "")]
        st = (await stats(c))["engine"]["early_exit"]
        assert st["enabled"] and st["error"] is None
        c.workspace_did_change_configuration(T.DidChangeConfigurationParams(settings={"codecomplete": {
            "earlyExit": {**exits, "lossless": False, "measure": "softmax", "threshold": 1e-9},
            "speculation": {"enabled": False}}}))
        before = (await stats(c))["engine"]
        insert(c, uri, 2, len(lines) - 1, len(lines[-1]), "y")
        await complete(c, uri, len(lines) - 1, len(lines[-1]) + 1)
        after = (await stats(c))["engine"]
        assert after["early_exit"]["enabled"] and after["early_exit"]["error"] is None
        passes = after["decode_passes"] - before["decode_passes"]
        assert passes > 0
        # the tiny model has 2 layers: decode passes left at layer 1 (healing steps run both)
        assert after["layers_run"] - before["layers_run"] < 2 * passes
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_bf16_daemon_serves_through_the_native_step(repo, tiny_model, model_cache):
    """Guards the path the default model takes: bf16 weights, whose decode steps run as one
    native call (model/native) where a compiler is present; the daemon answers what an
    in-process bf16 engine with the same settings answers."""
    from codecomplete.model import native
    from codecomplete.model.api import SpecSettings

    off = {"speculation": {"enabled": False}}  # drafts come from the daemon's index: compare plain decoding
    ref = Engine(EngineSettings(model=str(tiny_model), dtype="bfloat16", speculation=SpecSettings(enabled=False)))
    ref.start()
    try:
        want = expected(ref, POINT, "")
        assert ref.lm.model.dtype.is_floating_point and str(ref.lm.dtype) == "torch.bfloat16"
        assert (ref.lm.model.native_stack is not None) == native.available()
    finally:
        ref.close()
    c = await start_daemon(repo, tiny_model, init_options={"codecomplete": off}, extra_args=("--dtype", "bfloat16"))
    try:
        uri = (repo / "bf16.py").as_uri()
        open_doc(c, uri, POINT)
        lines = POINT.split("\n")
        items = await complete(c, uri, len(lines) - 1, len(lines[-1]))
        assert want.strip() and proposed(items, LAST) == [want]
        assert (await stats(c))["engine"]["dtype"] == "bfloat16"
        if native.available():  # kernels built: nothing to warn of
            assert (await stats(c))["engine"]["native"] == {"loaded": True, "problem": None}
            assert not [m for m in c.messages if "native CPU kernels" in m.message]
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_without_its_native_kernels_the_daemon_says_why_once_and_still_answers(repo, tiny_model, model_cache,
                                                                                    reference_engine, tmp_path,
                                                                                    monkeypatch):
    """Guards the warning a user sees when the kernels cannot be built (no C compiler): one
    window/showMessage naming the reason, at the first completion, and the same completions from
    PyTorch's path. With the kernels built (or turned off on purpose) no such message comes."""
    want = expected(reference_engine, POINT, "")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("CODECOMPLETE_NATIVE_DIR", str(tmp_path / "native"))  # nothing built there
    c = await start_daemon(repo, tiny_model)
    try:
        uri = (repo / "slow.py").as_uri()
        open_doc(c, uri, POINT)
        lines = POINT.split("\n")
        for _ in range(2):
            items = await complete(c, uri, len(lines) - 1, len(lines[-1]), invoked=True)
            assert proposed(items, LAST)[0] == want
        warned = [m.message for m in c.messages if "native CPU kernels" in m.message]
        assert len(warned) == 1 and "no-such-cc" in warned[0], c.messages
        native = (await stats(c))["engine"]["native"]
        assert native["loaded"] is False and "no-such-cc" in native["problem"]
    finally:
        await c.shutdown_session()
        await c.stop()

    # off on purpose, still without a compiler: nothing to tell
    for off in ({"CODECOMPLETE_NATIVE": "0"}, {"init": {"codecomplete": {"model": {"native_attention": False}}}}):
        if "CODECOMPLETE_NATIVE" in off:
            monkeypatch.setenv("CODECOMPLETE_NATIVE", "0")
        else:
            monkeypatch.delenv("CODECOMPLETE_NATIVE")
        c = await start_daemon(repo, tiny_model, init_options=off.get("init"))
        try:
            uri = (repo / "off.py").as_uri()
            open_doc(c, uri, POINT)
            assert proposed(await complete(c, uri, len(lines) - 1, len(lines[-1]), invoked=True), LAST)[0] == want
            assert not [m for m in c.messages if "native CPU kernels" in m.message], off
            native = (await stats(c))["engine"]["native"]
            assert native["problem"] is None and native["loaded"] is False, (off, native)
        finally:
            await c.shutdown_session()
            await c.stop()


async def test_the_next_daemon_loads_the_packed_weights_the_first_one_kept(repo, tiny_model, model_cache, tmp_path,
                                                                            monkeypatch):
    """Guards the packed weights' cache across daemons (model/packcache.py): the first daemon of
    a bf16 model keeps its native copies in the cache, a whole file by the time it has exited,
    and the next one reads that file ahead, beside torch's import, loads from it and answers the
    same."""
    from codecomplete.model import native

    if not native.available():
        pytest.skip("no native kernels here")
    monkeypatch.setenv("CODECOMPLETE_NATIVE_DIR", str(model_cache))  # the kernels built already
    monkeypatch.setenv("CODECOMPLETE_CACHE_DIR", str(tmp_path / "cache"))  # no packed weights yet
    off = {"speculation": {"enabled": False}}
    seen = []
    for _ in range(2):
        c = await start_daemon(repo, tiny_model, init_options={"codecomplete": off}, extra_args=("--dtype", "bfloat16"))
        try:
            uri = (repo / "packed.py").as_uri()
            open_doc(c, uri, POINT)
            lines = POINT.split("\n")
            items = await complete(c, uri, len(lines) - 1, len(lines[-1]))
            now = await stats(c)
            engine = now["engine"]
            seen.append((proposed(items, LAST), engine["load_prepacked"], engine["load_read_ahead"]))
            # the collector, off while the daemon started (daemon/startgc.py), is on again once loaded
            assert now["gc"]["enabled"] and now["gc"]["frozen"] > 0
        finally:
            await c.shutdown_session()
            await c.stop()
        kept = sorted(p.name for p in (tmp_path / "cache" / "packed").iterdir())
        assert len(kept) == 2 and kept[0].endswith(".pack") and kept[1] == "hints.json", kept  # no partial file
    (first, first_packed, _), (second, second_packed, second_ahead) = seen
    assert not first_packed and second_packed and second_ahead  # read before torch's import, even
    assert first == second and first[0].strip()


async def test_typing_through_a_completion_keeps_its_rest_without_the_model(repo, tiny_model, model_cache,
                                                                             reference_engine):
    """Guards typing through: typing the start of the shown completion answers with its rest
    (no new model run); typing something else, or with the setting off, runs the model."""
    want = expected(reference_engine, POINT, "")
    assert len(want.strip()) >= 2, "the tiny model should complete this prompt"
    cut = len(want) - len(want.lstrip()) + 1  # the completion's first visible character, typed
    for on in (True, False):
        client = await start_daemon(repo, tiny_model, init_options={"completion": {"typeThrough": on}})
        try:
            uri = (repo / f"through_{on}.py").as_uri()
            open_doc(client, uri, POINT)
            assert proposed(await complete(client, uri, 3, 13), LAST) == [want]
            insert(client, uri, 2, 3, 13, want[:cut])
            items = await complete(client, uri, 3, 13 + cut, invoked=False)
            counters = (await stats(client))["counters"]
            if on:
                assert proposed(items, LAST + want[:cut]) == [want[cut:]]
                assert counters["typed_through"] == 1 and counters["completions"] == 2
            else:  # the model ran again: what a fresh session would answer there
                assert proposed(items, LAST + want[:cut]) == [expected(reference_engine, POINT + want[:cut], "")]
                assert counters["typed_through"] == 0
            # a character that the completion does not have next: the model runs again
            insert(client, uri, 3, 3, 13 + cut, "\u00a7")
            items = await complete(client, uri, 3, 14 + cut)
            assert (await stats(client))["counters"]["typed_through"] == (1 if on else 0)
            assert proposed(items, LAST + want[:cut] + "\u00a7") == (
                [expected(reference_engine, POINT + want[:cut] + "\u00a7", "")] if items else [])
        finally:
            await client.shutdown_session()
            await client.stop()


async def test_typing_along_a_completion_still_being_made_keeps_its_run(repo, model_cache):
    """Guards typing along (completion.type_along) in the real daemon with the default model,
    whose multi-line completion here takes many decode steps: a keystroke while the request's
    run is in flight makes the request stale without stopping the run, and the request at the
    next character gets the run's rest; the model ran once for both."""
    text = "class Config:\n    def __init__(self, host, port, user, password, timeout, retries, verbose):\n        "
    c = await start_daemon(repo, "default", init_options={"completion": {
        "debounceMs": 0, "mode": "multi", "maxTokens": 160, "maxLines": 40, "timeBudgetMs": 60000}})
    try:
        for _ in range(1200):
            if (await stats(c))["engine"]["ready"]:
                break
            await asyncio.sleep(0.1)
        uri = (repo / "along.py").as_uri()
        open_doc(c, uri, text)
        first = asyncio.ensure_future(complete(c, uri, 2, 8))
        for _ in range(200):  # the daemon took the request (with no debounce: its run is submitted)
            if (await stats(c))["counters"]["requests"]:
                break
            await asyncio.sleep(0.005)
        insert(c, uri, 2, 2, 8, "s")  # "self.host = host" and on: its first character
        second = await complete(c, uri, 2, 9)
        assert await first == []  # stale: the document changed
        now = await stats(c, recent=True)
        assert now["counters"]["followed"] == 1, now["counters"]
        assert (now["engine"]["completions"], now["engine"]["cancelled"]) == (1, 0)  # one run, not stopped
        assert [(r["status"], r["prompt_kind"]) for r in now["recent"]] == [("stale", ""), ("answered", "followed")]
        (item,) = second
        rest = item.insert_text[len("        s"):]
        assert rest.startswith("elf.") and "\n" in rest, rest  # the run's own text: the attributes, line by line
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_typing_through_a_bracket_the_editor_closed(repo, tiny_model, model_cache, reference_engine):
    """Guards typing through with pairs closed by the editor (VS Code's autoClosingBrackets,
    Neovim's autopairs): typing the completion up to its ``(`` puts ``)`` after the cursor; the
    daemon still answers with the completion's rest, without the model, in an item whose range
    covers that ``)``, so accepting it gives the line the completion would have given."""
    text = POINT + "y = "
    want = expected(reference_engine, text, "")
    assert "(" in want.rstrip()[:-1], f"the tiny model should open a bracket here: {want!r}"
    typed = want[:want.index("(") + 1]
    client = await start_daemon(repo, tiny_model)
    try:
        uri = (repo / "pairs.py").as_uri()
        open_doc(client, uri, text)
        line, col = 3, len(text.split("\n")[-1])
        (first,) = await complete(client, uri, line, col)
        assert proposed([first], text.split("\n")[-1]) == [want]
        # the line after the cursor as it was, for a client whose item is older than its keystrokes
        assert {k: first.command.arguments[0].get(k) for k in ("replaces", "after")} == {"replaces": "", "after": ""}
        insert(client, uri, 2, line, col, typed + ")")  # the editor closed the bracket
        (item,) = await complete(client, uri, line, col + len(typed))
        counters = (await stats(client))["counters"]
        assert counters["typed_through"] == 1 and counters["completions"] == 2
        assert (item.range.start.character, item.range.end.character) == (0, col + len(typed) + 1)
        assert item.insert_text == text.split("\n")[-1] + want  # the line as the completion made it
        assert {k: item.command.arguments[0].get(k) for k in ("replaces", "after")} == {"replaces": ")", "after": ""}
    finally:
        await client.shutdown_session()
        await client.stop()


def expected_all(engine: Engine, prefix: str, suffix: str, n: int) -> list[str]:
    """What an invoked request offers: the completion, then its alternatives."""
    return engine.complete(CompletionRequest(prefix, suffix, session_key=f"reference-{next(_KEYS)}",
                                             alternatives=n)).texts


async def test_an_invoked_request_offers_alternatives(repo, tiny_model, model_cache, reference_engine):
    """Guards alternatives: a request the user invoked (VS Code's Alt+\\ and its cycling,
    the Neovim plugin's next key) gets the greedy completion first, then up to
    completion.alternatives - 1 others, each its own item with its own id (an accepted one
    is counted as an alternative); a request made while typing gets the first alone; where
    the greedy completion is empty, an invoked request still gets the others; a menu
    request gets one item; completion.alternatives = 1 turns them off."""
    client = await start_daemon(repo, tiny_model)
    try:
        uri = (repo / "alt.py").as_uri()
        open_doc(client, uri, POINT)
        lines = POINT.split("\n")
        at = (len(lines) - 1, len(lines[-1]))
        want = expected_all(reference_engine, POINT, "", 3)
        assert len(want) > 1, "the tiny model should have alternatives here"
        items = await complete(client, uri, *at, invoked=True)
        assert proposed(items, LAST) == want
        ids = [i.command.arguments[0]["completionId"] for i in items]
        assert len(set(ids)) == len(ids) and ids[1:] == [f"{ids[0]}.{k}" for k in range(2, len(ids) + 1)]
        assert all(i.range == items[0].range for i in items)
        await client.workspace_execute_command_async(T.ExecuteCommandParams(
            command=items[1].command.command, arguments=items[1].command.arguments))
        typing = await complete(client, uri, *at)
        assert proposed(typing, LAST) == want[:1]
        counters = (await stats(client))["counters"]
        assert counters["accepted"] == 1 and counters["accepted_alternatives"] == 1
        assert counters["alternatives"] == len(want) - 1

        # typing out an alternative keeps it, without the model (typing through)
        other = want[1]
        k = next(i for i, (x, y) in enumerate(zip(other + "\0", want[0] + "\1")) if x != y) + 1
        assert other[k:].strip(), "the alternative should go on after where it departs from the first"
        uri3 = (repo / "through.py").as_uri()
        open_doc(client, uri3, POINT)
        assert proposed(await complete(client, uri3, *at, invoked=True), LAST) == want
        insert(client, uri3, 2, at[0], at[1], other[:k])
        before = (await stats(client))["counters"]["typed_through"]
        assert proposed(await complete(client, uri3, at[0], at[1] + k), LAST + other[:k]) == [other[k:]]
        assert (await stats(client))["counters"]["typed_through"] == before + 1

        # the model would stop at once here: typing gets nothing, asking gets the others
        empty = "def main():\n    "
        assert not expected_all(reference_engine, empty, "", 1)
        others = expected_all(reference_engine, empty, "", 3)
        assert others, "the tiny model should have alternatives here"
        uri2 = (repo / "main.py").as_uri()
        open_doc(client, uri2, empty)
        assert await complete(client, uri2, 1, 4) == []
        assert proposed(await complete(client, uri2, 1, 4, invoked=True), "    ") == others

        client.workspace_did_change_configuration(T.DidChangeConfigurationParams(
            settings={"codecomplete": {"completion": {"alternatives": 1}}}))
        assert proposed(await complete(client, uri, *at, invoked=True), LAST) == want[:1]
    finally:
        await client.shutdown_session()
        await client.stop()
    menu_only = await start_daemon(repo, tiny_model, inline=False)
    try:
        uri = (repo / "m.py").as_uri()
        open_doc(menu_only, uri, POINT)
        [item] = (await menu(menu_only, uri, *at)).items
        assert item.text_edit.new_text == want[0]  # no word typed after "self."
    finally:
        await menu_only.shutdown_session()
        await menu_only.stop()


def delete(client, uri: str, version: int, line: int, start: int, end: int) -> None:
    client.text_document_did_change(T.DidChangeTextDocumentParams(
        T.VersionedTextDocumentIdentifier(uri=uri, version=version),
        [T.TextDocumentContentChangePartial(range=T.Range(T.Position(line, start), T.Position(line, end)), text="")]))


async def test_a_request_for_text_seen_before_is_answered_from_the_cache(repo, tiny_model, model_cache,
                                                                        reference_engine):
    """Guards the completion cache: a request whose document text and cursor are an earlier
    request's (a typo typed and deleted) gets that request's completion without the model;
    the number of completions asked for is part of the key (an invoked request runs the model
    the first time, and is cached itself), but an invoked request's first completion also
    answers a later request while typing; closing the document forgets its entries; a setting
    change empties the cache and cache_entries = 0 turns it off."""
    want = expected(reference_engine, POINT, "")
    assert want.strip(), "the tiny model should complete this prompt"
    client = await start_daemon(repo, tiny_model)
    try:
        uri = (repo / "cached.py").as_uri()
        at = (3, 13)

        async def ask(invoked: bool = False) -> tuple[list[str], dict, dict]:
            items = await complete(client, uri, *at, invoked=invoked)
            s = await stats(client)
            return proposed(items, LAST), s["counters"], s["engine"]

        open_doc(client, uri, POINT)
        first, counters, engine = await ask()
        assert first == [want] and counters["cached"] == 0
        runs = engine["completions"]
        insert(client, uri, 2, *at, "\u00a7")  # a typo, then its deletion: the same text again
        await complete(client, uri, at[0], at[1] + 1)
        delete(client, uri, 3, at[0], at[1], at[1] + 1)
        again, counters, engine = await ask()
        assert again == [want] and counters["cached"] == 1
        assert engine["completions"] == runs + 1  # the typo's request ran; this one did not

        everything = expected_all(reference_engine, POINT, "", 3)
        assert len(everything) > 1, "the tiny model should have alternatives here"
        asked, counters, engine = await ask(invoked=True)
        assert asked == everything and counters["cached"] == 1 and engine["completions"] > runs + 1
        runs = engine["completions"]
        asked, counters, engine = await ask(invoked=True)
        assert asked == everything and counters["cached"] == 2 and engine["completions"] == runs

        client.text_document_did_close(T.DidCloseTextDocumentParams(T.TextDocumentIdentifier(uri=uri)))
        open_doc(client, uri, POINT)
        asked, counters, engine = await ask(invoked=True)  # the model runs: closing forgot the entries
        assert asked == everything and counters["cached"] == 2 and engine["completions"] > runs
        runs = engine["completions"]
        typing, counters, engine = await ask()  # a request while typing gets the invoked one's first
        assert typing == [want] and counters["cached"] == 3 and engine["completions"] == runs

        def configure(entries: int) -> None:
            client.workspace_did_change_configuration(T.DidChangeConfigurationParams(
                settings={"codecomplete": {"completion": {"cacheEntries": entries}}}))

        async def model_runs() -> list[bool]:  # two requests at the same text: did each run the model?
            ran = []
            for _ in range(2):
                before = (await stats(client))["engine"]["completions"]
                answer, _, engine = await ask()
                assert answer == [want]
                ran.append(engine["completions"] == before + 1)
            return ran

        configure(128)  # a setting change empties the cache
        assert await model_runs() == [True, False]
        configure(0)  # off
        assert await model_runs() == [True, True]
        assert (await stats(client))["counters"]["cached"] == 4
    finally:
        await client.shutdown_session()
        await client.stop()


async def stats_when(c, ready, tries: int = 1200) -> dict:
    """The daemon's stats once ``ready(stats)`` holds (polled every 50 ms), or the last ones."""
    for _ in range(tries):
        s = await stats(c)
        if ready(s):
            break
        await asyncio.sleep(0.05)
    return s


async def test_a_client_that_asks_late_gets_the_run_started_at_the_pause(repo, tiny_model, model_cache):
    """Guards runs started ahead (completion.startAhead): a client whose automatic requests come
    0.4 s after the last keystroke (Neovim 0.12's: 0.2 s) types the same text into two documents,
    first with the setting "never", then "auto" (the first document's requests showed the client
    asks late): in the second each pause starts the completion, each request takes its run over
    (the requests run nothing themselves), and the answers are the first document's."""
    settings = {"startMs": 20, "warmMs": 0, "debounceMs": 0}
    c = await start_daemon(repo, tiny_model, init_options={"completion": {**settings, "startAhead": "never"}})
    pieces = ["def f", "(x):\n    return x\n\n", "def g", "("]

    async def type_and_ask(name: str) -> list:
        uri = (repo / name).as_uri()
        text = "import os\n\n"
        open_doc(c, uri, text)
        answers = []
        for version, piece in enumerate(pieces, start=2):
            lines = text.split("\n")
            insert(c, uri, version, len(lines) - 1, len(lines[-1]), piece)
            text += piece
            await asyncio.sleep(0.4)  # the client's wait after the last key
            lines = text.split("\n")
            answers.append([i.insert_text for i in await complete(c, uri, len(lines) - 1, len(lines[-1]))])
        return answers

    try:
        await stats_when(c, lambda s: s["engine"]["ready"])
        first = await type_and_ask("late_a.py")
        s = await stats(c)
        assert s["counters"]["started_ahead"] == 0
        runs = s["engine"]["completions"]
        c.workspace_did_change_configuration(T.DidChangeConfigurationParams(
            settings={"codecomplete": {"completion": {**settings, "startAhead": "auto"}}}))
        second = await type_and_ask("late_b.py")
        s = await stats(c, recent=True)
        assert second == first and any(first)
        started = s["counters"]["started_ahead"]
        assert started >= 1 and s["engine"]["completions"] - runs == started  # only the started runs ran
        answered = [r for r in s["recent"][-len(pieces):] if r["status"] == "answered"]
        assert answered and all(r["prompt_kind"] in ("followed", "typed-through", "cached") for r in answered)
        assert s["counters"]["followed"] >= 1
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_a_pause_in_a_notebook_cell_starts_the_cells_completion(repo, tiny_model, model_cache,
                                                                       reference_engine):
    """Guards runs started ahead and warm-ups in notebook cells (edited through
    notebookDocument/didChange): a keystroke in a cell warms its prompt, the pause after it
    starts the completion there with the cells around it, and the cell's request takes that run
    over (the request runs nothing itself) and gets the completion a fresh session gets."""
    c = await start_daemon(repo, tiny_model, init_options={"completion": {
        "startAhead": "always", "startMs": 150, "warmMs": 1, "debounceMs": 0}})
    try:
        await stats_when(c, lambda s: s["engine"]["ready"])
        nb = (repo / "ahead.ipynb").as_uri()
        cells = ["vscode-notebook-cell:" + (repo / "ahead.ipynb").as_posix() + f"#W{i}sZmlsZQ%3D%3D" for i in range(2)]
        texts = [POINT.rsplit("\n", 1)[0] + "\n", "p = Point(1, 2)\n"]
        c.notebook_document_did_open(T.DidOpenNotebookDocumentParams(
            notebook_document=T.NotebookDocument(uri=nb, notebook_type="jupyter-notebook", version=1, cells=[
                T.NotebookCell(kind=T.NotebookCellKind.Code, document=u) for u in cells]),
            cell_text_documents=[T.TextDocumentItem(uri=u, language_id="python", version=1, text=t)
                                 for u, t in zip(cells, texts)]))
        end = T.Position(1, 0)
        runs = (await stats(c))["engine"]["completions"]
        c.notebook_document_did_change(T.DidChangeNotebookDocumentParams(
            notebook_document=T.VersionedNotebookDocumentIdentifier(version=2, uri=nb),
            change=T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(text_content=[
                T.NotebookDocumentCellContentChanges(
                    document=T.VersionedTextDocumentIdentifier(uri=cells[1], version=2),
                    changes=[T.TextDocumentContentChangePartial(range=T.Range(end, end), text="p.")])]))))
        s = await stats_when(c, lambda s: s["counters"]["started_ahead"] == 1)
        assert s["counters"]["warmups"] == 1 and s["counters"]["server_errors"] == 0
        items = await complete(c, cells[1], 1, 2)
        want = expected(reference_engine, texts[0].rstrip("\n") + "\n\n" + texts[1] + "p.", "")
        assert proposed(items, "p.") == [want] and want
        s = await stats(c, recent=True)
        assert s["counters"]["followed"] == 1 and s["engine"]["completions"] == runs + 1  # the started run alone
        assert s["recent"][-1]["prompt_kind"] == "followed"
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_an_edit_on_a_new_line_warms_the_prompt_before_the_request(repo, tiny_model, model_cache,
                                                                          reference_engine):
    """Guards warm-ups (completion.warmMs): an edit on a line with no request yet prefills the
    prompt at the edit while the user has not asked; the request there then reuses it and
    gets the completion a fresh session gets; more typing on that line warms nothing more."""
    c = await start_daemon(repo, tiny_model, init_options={"codecomplete": {"completion": {"warmMs": 1}}})
    try:
        await stats_when(c, lambda s: s["engine"]["ready"])  # the model loads first (a warm-up would wait for it)
        uri = (repo / "warm.py").as_uri()
        body = "import os\n\n" + "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(30))
        open_doc(c, uri, body)
        lines = body.split("\n")
        end = len(lines) - 1  # the empty last line
        insert(c, uri, 2, end, 0, "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self")
        s = await stats_when(c, lambda s: s["engine"]["warm_prefills"])  # the warm-up runs in the background
        assert s["counters"]["warmups"] == 1 and s["engine"]["warm_prefills"] == 1
        warmed = s["engine"]["warm_tokens"]
        assert warmed > 100  # the whole prompt: the document was never prefilled
        insert(c, uri, 3, end + 3, 12, ".")  # typing on: the same line, no new warm-up
        await asyncio.sleep(0.3)
        items = await complete(c, uri, end + 3, 13)
        text = body + POINT
        assert proposed(items, LAST) == [expected(reference_engine, text, "")]
        s = await stats(c, recent=True)
        assert s["counters"]["warmups"] == 1 and s["engine"]["warm_prefills"] == 1
        record = s["recent"][-1]
        assert record["status"] == "answered" and record["reused_tokens"] >= warmed - 2
        # the plugins' didMoveCursor: where the cursor rests after navigating warms the same way
        c.protocol.notify("codecomplete/didMoveCursor", {"textDocument": {"uri": uri}})  # malformed: ignored
        c.protocol.notify("codecomplete/didMoveCursor", {"textDocument": {"uri": uri},
                                                         "position": {"line": 9, "character": 4}})
        s = await stats_when(c, lambda s: s["engine"]["warm_prefills"] == 2)
        assert s["counters"]["warmups"] == 2 and s["counters"]["server_errors"] == 0
        await complete(c, uri, 9, 4)
        record = (await stats(c, recent=True))["recent"][-1]
        assert record["status"] == "answered" and record["reused_tokens"] >= record["prompt_tokens"] - 3
        # a cursor said before its document's didOpen (a client's start): the warm-up waits for the open
        other = (repo / "later.py").as_uri()
        c.protocol.notify("codecomplete/didMoveCursor", {"textDocument": {"uri": other},
                                                         "position": {"line": 20, "character": 4}})
        await asyncio.sleep(0.3)
        assert (await stats(c))["engine"]["warm_prefills"] == 2  # nothing to warm yet
        open_doc(c, other, body)
        s = await stats_when(c, lambda s: s["engine"]["warm_prefills"] == 3)
        assert s["counters"]["warmups"] == 3 and s["engine"]["warm_prefills"] == 3
        await complete(c, other, 20, 4)
        record = (await stats(c, recent=True))["recent"][-1]
        assert record["status"] == "answered" and record["reused_tokens"] >= record["prompt_tokens"] - 3
    finally:
        await c.shutdown_session()
        await c.stop()


async def test_a_slow_block_comes_as_its_first_lines_then_its_rest(repo, model_cache):
    """Guards completion.firstLinesMs with the real default model: a block the model is still
    writing is answered with its whole lines so far; accepting them types along its run, and
    the request after the accept gets the run's rest (no second run); the two together are the
    completion a fresh session gets at the first cursor."""
    c = await start_daemon(repo, "default", first_lines_ms=1, init_options={"completion": {
        "debounceMs": 0, "warmMs": 0, "startAhead": "never", "timeBudgetMs": 60000}})
    reference = Engine(EngineSettings(model="default", dtype="float32")).start()
    try:
        await stats_when(c, lambda s: s["engine"]["ready"])
        uri = (repo / "fib.py").as_uri()
        head = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
        open_doc(c, uri, head + "    \n")
        runs = (await stats(c))["engine"]["completions"]
        items = await complete(c, uri, 2, 4)
        s = await stats(c, recent=True)
        assert s["counters"]["first_lines"] == 1 and s["recent"][-1]["stop_reason"] == "first_lines"
        early = s["recent"][-1]  # the run's prompt and its engine time so far, for the replay's split
        assert early["prompt_tokens"] > early["reused_tokens"] >= 0 and early["generated_tokens"] >= 2
        assert early["prefill_ms"] > 0 and early["decode_ms"] > 0
        assert early["queue_ms"] + early["prefill_ms"] + early["decode_ms"] <= early["latency_ms"] + 1
        lines, = proposed(items, "    ")
        assert lines.strip() and not lines.endswith("\n")
        insert(c, uri, 2, 2, 4, lines)  # the user accepts them
        row = 2 + lines.count("\n")
        col = len(("    " + lines).split("\n")[-1])
        rest = await complete(c, uri, row, col)
        s = await stats(c, recent=True)
        assert s["recent"][-1]["prompt_kind"] == "followed" and s["counters"]["followed"] == 1
        assert s["engine"]["completions"] == runs + 1  # one run for both answers
        typed = ("    " + lines).split("\n")[-1]
        whole = lines + proposed(rest, typed)[0]
        # no time budget on either side: the fp32 model here writes ~25 tokens a second, and a cut is no answer
        assert whole == expected(reference, head + "    ", "\n", time_budget_ms=60000) and "\n" in whole.strip()
    finally:
        reference.close()
        await c.shutdown_session()
        await c.stop()
