"""Typing along a run in flight (``completion.type_along``, lsp/server.py): the server's
rules, with an engine whose runs finish when the test says (``HeldEngine``), so that each
edit and request lands while a run is known to be in flight.  The engine's own side (it
stops a run whose text departs from the typed) is in test_engine.py; the real daemon's in
test_lsp_e2e.py and the replay harness (bench/results)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from lsprotocol import types as T

from codecomplete.daemon.config import Config
from codecomplete.lsp.server import CodecompleteServer, first_lines, text_along, typed_between
from codecomplete.lsp.workspace import LspWorkspace
from codecomplete.model.api import Completion, CompletionRequest
from codecomplete.model.stops import agrees

URI = "file:///work/sums.py"
TEXT = "def total(a, b):\n    \n"  # the cursor: line 1, character 4
WRITES = "result = a + b\n    return result"  # what the run writes there


class HeldEngine:
    """``submit`` hands back a future that the test resolves (``finish``); what a run has
    written so far is set by the test too (``request.set_progress``), as the real engine sets it
    after each token."""

    def __init__(self):
        self.runs: list[tuple[CompletionRequest, concurrent.futures.Future]] = []

    def submit(self, request: CompletionRequest) -> concurrent.futures.Future:
        fut = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        self.runs.append((request, fut))
        return fut

    def finish(self, i: int, text: str, reason: str = "block_end") -> None:
        request, fut = self.runs[i]
        fut.set_result(Completion("", "cancelled") if request.cancel.is_set() else
                       Completion(text, reason, prompt_tokens=20, generated_tokens=9, multiline=True))


def server(**completion) -> tuple[CodecompleteServer, HeldEngine]:
    config = Config()
    config.completion.debounce_ms = 0
    config.completion.first_lines_ms = 0  # on by default; the tests of it set it
    for k, v in completion.items():
        setattr(config.completion, k, v)
    engine = HeldEngine()
    ls = CodecompleteServer(engine, config)
    ls.protocol._workspace = LspWorkspace(None, T.TextDocumentSyncKind.Incremental)
    ls.workspace.put_text_document(T.TextDocumentItem(uri=URI, language_id="python", version=1, text=TEXT))
    return ls, engine


def type_at(ls: CodecompleteServer, line: int, character: int, text: str) -> None:
    """A keystroke as a client sends it: the workspace takes the edit, then the server's handler."""
    doc = ls.workspace.get_text_document(URI)
    pos = T.Position(line, character)
    params = T.DidChangeTextDocumentParams(T.VersionedTextDocumentIdentifier(uri=URI, version=doc.version + 1),
                                           [T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text=text)])
    ls.workspace.update_text_document(params.text_document, params.content_changes[0])
    ls.changed(params)


def ask(ls: CodecompleteServer, line: int, character: int, uri: str = URI) -> asyncio.Task:
    params = T.InlineCompletionParams(
        context=T.InlineCompletionContext(trigger_kind=T.InlineCompletionTriggerKind.Automatic),
        text_document=T.TextDocumentIdentifier(uri=uri), position=T.Position(line, character))
    return asyncio.ensure_future(ls.inline_completion(params))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def offered(result: T.InlineCompletionList, line_typed: str) -> list[str]:
    """The items' text after what the line already has before the cursor."""
    return [item.insert_text[len(line_typed):] for item in result.items]


async def test_typing_along_a_run_keeps_it_and_the_next_request_takes_its_rest():
    ls, engine = server()
    first = ask(ls, 1, 4)
    await settle()
    (request, _), = engine.runs
    request.set_progress("res")  # three characters written so far
    type_at(ls, 1, 4, "r")
    type_at(ls, 1, 5, "e")
    # the first request answers nothing at once (its cursor is gone); its run goes on
    assert (await asyncio.wait_for(first, 1)).items == []
    assert not request.cancel.is_set() and request.typed == "re"
    second = ask(ls, 1, 6)
    await settle()
    assert not second.done()  # it waits for the run
    engine.finish(0, WRITES)
    result = await asyncio.wait_for(second, 1)
    assert offered(result, "    re") == [WRITES[2:]]
    assert len(engine.runs) == 1  # one model run for both requests
    c = ls.counters
    assert (c.followed, c.completions, c.stale, c.typed_through) == (1, 1, 1, 0)
    kinds = [(r["status"], r["prompt_kind"]) for r in ls.recent]
    assert kinds == [("stale", ""), ("answered", "followed")]
    # typing on through the answer is typing through (the completion is the run's, at its cursor)
    type_at(ls, 1, 6, "s")
    third = await asyncio.wait_for(ask(ls, 1, 7), 1)
    assert offered(third, "    res") == [WRITES[3:]] and ls.counters.typed_through == 1


async def test_the_debounce_counts_the_quiet_since_the_last_keystroke_or_request():
    """Guards completion.debounce_ms as quiet time: a request right after a keystroke waits it
    (a key typed meanwhile means no run at all); one that comes after the user has been still
    that long (an editor that asks late) runs at once; a request right after another with no
    edit between (the cursor moving line by line) waits it again."""
    ls, engine = server(debounce_ms=300)
    type_at(ls, 1, 4, "r")
    first = ask(ls, 1, 5)
    await settle()
    assert engine.runs == []  # waiting out the quiet time
    type_at(ls, 1, 5, "e")
    assert (await asyncio.wait_for(first, 2)).items == [] and engine.runs == []  # typed past: never run
    ls.config.completion.debounce_ms = 100
    await asyncio.sleep(0.2)  # the user is still for longer than the debounce, then the editor asks
    second = ask(ls, 1, 6)
    await settle()
    assert len(engine.runs) == 1  # no wait left
    engine.finish(0, "sult = a + b")
    assert offered(await asyncio.wait_for(second, 1), "    re") == ["sult = a + b"]
    ls.config.completion.debounce_ms = 1000
    third = ask(ls, 2, 0)  # right after the last request, no edit since: the whole wait again
    await settle()
    assert len(engine.runs) == 1
    type_at(ls, 2, 0, "x")
    ls.config.completion.debounce_ms = 0
    assert (await asyncio.wait_for(third, 3)).items == [] and len(engine.runs) == 1


async def test_typing_ahead_of_what_the_run_wrote_keeps_it_until_it_departs():
    ls, engine = server()
    first = ask(ls, 1, 4)
    await settle()
    (request, _), = engine.runs
    type_at(ls, 1, 4, "res")  # nothing written yet: nothing to disagree with
    assert not request.cancel.is_set() and request.typed == "res"
    assert (await asyncio.wait_for(first, 1)).items == []
    request.set_progress("ret")  # it wrote something else than typed: the next keystroke ends it
    type_at(ls, 1, 7, "u")
    assert request.cancel.is_set() and ls.following == {}
    second = ask(ls, 1, 8)
    await settle()
    assert len(engine.runs) == 2 and engine.runs[1][0].prefix.endswith("    resu")  # a run of its own
    engine.finish(1, "lt = a + b")
    assert offered(await asyncio.wait_for(second, 1), "    resu") == ["lt = a + b"]
    assert ls.counters.followed == 0


async def test_a_run_that_ends_before_the_typed_text_leaves_the_request_its_own_run():
    ls, engine = server()
    first = ask(ls, 1, 4)
    await settle()
    engine.runs[0][0].set_progress("re")
    type_at(ls, 1, 4, "re")
    await asyncio.wait_for(first, 1)
    second = ask(ls, 1, 6)
    await settle()
    engine.finish(0, "re", reason="line_end")  # nothing left after what was typed
    await settle()
    assert len(engine.runs) == 2  # the request ran the model itself
    engine.finish(1, "sult = a + b")
    assert offered(await asyncio.wait_for(second, 1), "    re") == ["sult = a + b"]
    assert ls.counters.followed == 0


async def test_a_request_at_the_same_text_takes_over_the_run_in_flight():
    """An editor that asks again without an edit (VS Code after a focus change) gets the run
    already going, not a second one."""
    ls, engine = server()
    first = ask(ls, 1, 4)
    await settle()
    second = ask(ls, 1, 4)
    assert (await asyncio.wait_for(first, 1)).items == []  # superseded: handed its run on
    assert len(engine.runs) == 1 and not engine.runs[0][0].cancel.is_set()
    engine.finish(0, WRITES)
    assert offered(await asyncio.wait_for(second, 1), "    ") == [WRITES]
    assert ls.counters.followed == 1


async def test_the_client_cancelling_the_stale_request_does_not_stop_a_run_typed_along():
    ls, engine = server()
    first = ask(ls, 1, 4)
    await settle()
    request = engine.runs[0][0]
    first.cancel()  # as VS Code cancels the request of a keystroke ago: before the edit is seen
    await settle()
    assert request.cancel.is_set()  # nobody typed along it: it stops
    third = ask(ls, 1, 4)
    await settle()
    request = engine.runs[1][0]
    type_at(ls, 1, 4, "r")  # the edit first, then the client's cancel
    third.cancel()
    await settle()
    assert not request.cancel.is_set() and ls.following
    fourth = ask(ls, 1, 5)
    await settle()
    fourth.cancel()  # the request that took it over is cancelled and nothing was typed since: it stops
    await settle()
    assert request.cancel.is_set()


async def test_an_edit_elsewhere_or_the_setting_off_stops_the_run_as_before():
    ls, engine = server()
    first = ask(ls, 1, 4)
    await settle()
    type_at(ls, 0, 0, "#")  # another line: the run's cursor text is gone
    assert engine.runs[0][0].cancel.is_set()
    engine.finish(0, WRITES)  # the engine answers a cancelled run at its next step
    assert (await asyncio.wait_for(first, 1)).items == [] and ls.counters.stale == 1
    ls, engine = server(type_along=False)
    first = ask(ls, 1, 4)
    await settle()
    engine.runs[0][0].set_progress("res")
    type_at(ls, 1, 4, "r")
    assert engine.runs[0][0].cancel.is_set() and ls.following == {}
    engine.finish(0, WRITES)
    assert (await asyncio.wait_for(first, 1)).items == []


def test_the_text_typed_at_a_cursor():
    assert text_along("a = ", "\n", "a = f(", ")\n") == ("f(", 1)  # the editor closed the bracket
    assert text_along("a = ", "\n", "a = ", "\n") == ("", 0)
    assert text_along("a = ", "\n", "b = f", "\n") is None  # changed before the cursor
    assert text_along("a = ", "\n", "a = f", "]\n") is None  # a closer nothing typed opened
    assert text_along("x\r\n", "", "x\r\n  y\r\n", "") == ("  y\n", 0)
    # the document's text alone (no cursor): its end is read as closers wherever it can be
    assert typed_between("a = f()\n", "a = ", "\n") == "f("
    assert typed_between('a = f("")\n', "a = ", "\n") == 'f("'
    assert typed_between("a = fx\n", "a = ", "\n") == "fx"
    assert typed_between("b = f\n", "a = ", "\n") is None
    assert agrees("return x", "ret") and agrees("ret", "return x") and agrees("", "r")
    assert not agrees("return x", "reg")
    # a character split between byte-level tokens (the run wrote half of 語 so far) agrees with it typed
    assert agrees("# 日本\ufffd", "# 日本語") and not agrees("# 日本\ufffd", "# 日曜")


NOTEBOOK = "file:///work/analysis.ipynb"
CELLS = [f"vscode-notebook-cell:/work/analysis.ipynb#W{i}sZmlsZQ%3D%3D" for i in range(2)]


class Notebook:
    """A two-cell notebook open in ``ls`` (``import math`` above ``TEXT``), changed as VS Code's
    Jupyter sends it: the workspace takes the change, then the server's handler."""

    def __init__(self, ls: CodecompleteServer):
        self.ls = ls
        self.version = iter(range(2, 100))
        ls.workspace.put_notebook_document(T.DidOpenNotebookDocumentParams(
            notebook_document=T.NotebookDocument(uri=NOTEBOOK, notebook_type="jupyter-notebook", version=1, cells=[
                T.NotebookCell(kind=T.NotebookCellKind.Code, document=u) for u in CELLS]),
            cell_text_documents=[T.TextDocumentItem(uri=u, language_id="python", version=1, text=t)
                                 for u, t in zip(CELLS, ["import math\n", TEXT])]))

    def change(self, event: T.NotebookDocumentChangeEvent) -> None:
        params = T.DidChangeNotebookDocumentParams(
            notebook_document=T.VersionedNotebookDocumentIdentifier(version=next(self.version), uri=NOTEBOOK),
            change=event)
        self.ls.workspace.update_notebook_document(params)
        self.ls.notebook_changed(params)

    def type_in_cell(self, cell: int, line: int, character: int, text: str) -> None:
        pos = T.Position(line, character)
        self.change(T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(text_content=[
            T.NotebookDocumentCellContentChanges(
                document=T.VersionedTextDocumentIdentifier(uri=CELLS[cell], version=next(self.version)),
                changes=[T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text=text)])])))


async def test_typing_along_in_a_notebook_cell_keeps_the_run_a_cell_moved_stops_it():
    """Notebooks synced as notebooks (VS Code's Jupyter): a keystroke in the cell, alone in its
    notebookDocument/didChange, is followed like a text document's; a change to the cells'
    structure (the run's context: the cells around it) stops the run."""
    ls, engine = server()
    notebook = Notebook(ls)
    first = ask(ls, 1, 4, CELLS[1])
    await settle()
    (request, _), = engine.runs
    assert request.prefix.startswith("import math\n")  # the cell above is the prompt's context
    request.set_progress("res")
    notebook.type_in_cell(1, 1, 4, "re")
    assert not request.cancel.is_set() and request.typed == "re"
    assert (await asyncio.wait_for(first, 1)).items == []
    second = ask(ls, 1, 6, CELLS[1])
    await settle()
    engine.finish(0, WRITES)
    assert offered(await asyncio.wait_for(second, 1), "    re") == [WRITES[2:]] and ls.counters.followed == 1
    third = ask(ls, 0, 11, CELLS[0])  # a run in the first cell; then the cells are reordered
    await settle()
    engine.runs[1][0].set_progress("\nimport os")
    notebook.change(T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(
        structure=T.NotebookDocumentCellChangeStructure(array=T.NotebookCellArrayChange(start=1, delete_count=1)))))
    assert engine.runs[1][0].cancel.is_set() and ls.following == {}
    engine.finish(1, "\nimport os")
    assert (await asyncio.wait_for(third, 1)).items == []


async def test_an_edit_to_another_notebook_cell_stops_a_cells_run():
    """The other cells are a cell's prompt context: an edit in one of them stops the run typed
    along in a cell (it waits for no request any more) and a cell's request in flight, as an
    edit elsewhere in a text document does."""
    ls, engine = server()
    notebook = Notebook(ls)
    first = ask(ls, 1, 4, CELLS[1])
    await settle()
    request = engine.runs[0][0]
    request.set_progress("res")
    notebook.type_in_cell(1, 1, 4, "r")  # along the run: it goes on for the next request
    assert ls.following and not request.cancel.is_set()
    assert (await asyncio.wait_for(first, 1)).items == []
    notebook.type_in_cell(0, 1, 0, "import os\n")  # the cell above
    assert request.cancel.is_set() and ls.following == {}
    second = ask(ls, 1, 9, CELLS[0])  # a request in flight in the first cell, then a keystroke in the second
    await settle()
    notebook.type_in_cell(1, 1, 5, "e")
    assert engine.runs[1][0].cancel.is_set()
    engine.finish(1, "\nimport sys")
    assert (await asyncio.wait_for(second, 1)).items == []
    assert ls.counters.stale == 2 and ls.counters.followed == 0


async def test_a_client_that_leaves_stops_the_runs_it_typed_along():
    """A TCP client that disconnects (end_connection): a run it typed along, waiting for its next
    request, stops with its requests."""
    ls, engine = server()
    first = ask(ls, 1, 4)
    await settle()
    request = engine.runs[0][0]
    type_at(ls, 1, 4, "r")
    assert ls.following and not request.cancel.is_set()
    await asyncio.wait_for(first, 1)
    ls.end_connection()
    assert request.cancel.is_set() and ls.following == {} and ls.pending == {}


# -- runs started ahead (completion.start_ahead): the completion begun at a pause, before the
# editor asks (Neovim 0.12's client asks 200 ms after the last key)

async def pause(ms: float = 30) -> None:
    """The user stops typing for ``ms`` (past ``start_ms`` = 1 in these tests)."""
    await asyncio.sleep(ms / 1000)
    await settle()


async def test_a_pause_starts_the_run_and_the_request_after_it_takes_it_over():
    ls, engine = server(start_ahead="always", start_ms=1, warm_ms=0)
    type_at(ls, 1, 4, "r")
    await pause()
    (request, _), = engine.runs  # started at the cursor, before any request
    assert request.prefix == "def total(a, b):\n    r" and request.suffix == "\n"
    assert ls.following[URI].request is request and ls.counters.started_ahead == 1
    request.set_progress("esu")
    type_at(ls, 1, 5, "e")  # typed along it: it goes on, and no second run starts
    await pause()
    assert len(engine.runs) == 1 and not request.cancel.is_set() and request.typed == "e"
    answer = ask(ls, 1, 6)
    await settle()
    engine.finish(0, WRITES[1:])
    assert offered(await asyncio.wait_for(answer, 1), "    re") == [WRITES[2:]]
    assert len(engine.runs) == 1 and ls.counters.followed == 1 and ls.following == {}


async def test_a_run_started_ahead_stops_at_a_key_that_departs_and_a_new_pause_starts_another():
    ls, engine = server(start_ahead="always", start_ms=1, warm_ms=0)
    type_at(ls, 1, 4, "r")
    await pause()
    first = engine.runs[0][0]
    first.set_progress("esult")
    type_at(ls, 1, 5, "x")
    assert first.cancel.is_set() and ls.following == {}
    await pause()
    assert len(engine.runs) == 2 and engine.runs[1][0].prefix.endswith("    rx")
    engine.finish(0, "esult")
    answer = ask(ls, 1, 6)  # the request at the new run's text takes it
    await settle()
    engine.finish(1, " = a")
    assert offered(await asyncio.wait_for(answer, 1), "    rx") == [" = a"] and len(engine.runs) == 2


async def test_no_run_starts_ahead_where_the_request_would_not_run_the_model():
    """Inside a word (no completion while typing there), where the shown completion is typed
    through, with the setting "never" or typing along off, and while a request is in flight."""
    ls, engine = server(start_ahead="always", start_ms=1, warm_ms=0)
    type_at(ls, 1, 4, "pr")
    type_at(ls, 1, 5, "")  # no text: the cursor is at 5, between "p" and "r"
    await pause()
    assert ls.workspace.get_text_document(URI).source == "def total(a, b):\n    pr\n"
    assert engine.runs == []  # p|r: inside a word
    ls, engine = server(start_ahead="always", start_ms=1, warm_ms=0)
    answer = ask(ls, 1, 4)
    await settle()
    engine.finish(0, WRITES)
    await asyncio.wait_for(answer, 1)
    type_at(ls, 1, 4, "r")  # typing through the shown completion: answered without the model
    await pause()
    assert len(engine.runs) == 1 and ls.counters.started_ahead == 0
    for settings in ({"start_ahead": "never"}, {"start_ahead": "always", "type_along": False}):
        ls, engine = server(start_ms=1, warm_ms=0, **settings)
        type_at(ls, 1, 4, "r")
        await pause()
        assert engine.runs == [] and ls.counters.started_ahead == 0
    ls, engine = server(start_ahead="always", start_ms=1, warm_ms=0)
    type_at(ls, 1, 4, "r")
    answer = ask(ls, 1, 5)  # the editor asks before the start's time: its request runs, nothing else
    await settle()
    await pause()
    assert len(engine.runs) == 1 and engine.runs[0][0].request_id.startswith("c")
    assert ls.counters.started_ahead == 0
    engine.finish(0, "")
    await asyncio.wait_for(answer, 1)


async def test_auto_starts_ahead_only_for_an_editor_that_asks_late():
    """"auto": an editor whose automatic requests come right after the edit (VS Code) starts
    nothing ahead; one whose requests come later than the start would (by 50 ms or more) does."""
    ls, engine = server(start_ms=1, warm_ms=0)
    for k in range(8):  # asks at once after each key
        type_at(ls, 1, 4 + k, "x")
        answer = ask(ls, 1, 5 + k)
        await settle()
        engine.finish(len(engine.runs) - 1, "")
        await asyncio.wait_for(answer, 1)
    assert not ls.starts_ahead() and ls.counters.started_ahead == 0
    ls, engine = server(start_ms=1, warm_ms=0)
    for k in range(3):  # asks 60 ms after the key
        type_at(ls, 1, 4 + k, " ")
        await asyncio.sleep(0.06)
        if k < 2:
            assert ls.counters.started_ahead == 0
        answer = ask(ls, 1, 5 + k)
        await settle()
        engine.finish(len(engine.runs) - 1, "")
        await asyncio.wait_for(answer, 1)
    assert ls.starts_ahead()
    type_at(ls, 1, 7, "y")
    await pause()
    assert ls.counters.started_ahead == 1 and ls.following[URI].request.prefix.endswith("y")


async def test_a_pause_in_a_notebook_cell_starts_its_run_with_the_cells_around_it():
    """A keystroke in a cell (notebookDocument/didChange, one cell's text) is a keystroke as in a
    text document: the pause after it starts the cell's completion, its prompt holding the cell
    above; typing along keeps it, the cell's request takes it over.  An edit in another cell
    stops it, and a change to two cells' text at once starts nothing."""
    ls, engine = server(start_ahead="always", start_ms=1, warm_ms=0)
    notebook = Notebook(ls)
    notebook.type_in_cell(1, 1, 4, "r")
    await pause()
    (request, _), = engine.runs
    assert request.prefix == "import math\n\ndef total(a, b):\n    r" and request.suffix == "\n"
    assert ls.following[CELLS[1]].request is request and ls.counters.started_ahead == 1
    request.set_progress("esu")
    notebook.type_in_cell(1, 1, 5, "e")
    await pause()
    assert len(engine.runs) == 1 and not request.cancel.is_set() and request.typed == "e"
    answer = ask(ls, 1, 6, CELLS[1])
    await settle()
    engine.finish(0, WRITES[1:])
    assert offered(await asyncio.wait_for(answer, 1), "    re") == [WRITES[2:]]
    assert ls.counters.followed == 1 and ls.following == {}

    notebook.type_in_cell(1, 1, 6, "s")  # typing through the shown rest: nothing to start
    await pause()
    assert len(engine.runs) == 1
    notebook.type_in_cell(1, 1, 7, "x")  # departs from it: the pause starts a run ...
    await pause()
    second = engine.runs[1][0]
    assert second.prefix.endswith("    resx") and ls.counters.started_ahead == 2
    notebook.type_in_cell(0, 1, 0, "import os\n")  # ... that an edit in the cell above stops,
    assert second.cancel.is_set() and CELLS[1] not in ls.following
    await pause()  # and the pause there starts that cell's own
    third = engine.runs[2][0]
    assert third.prefix == "import math\nimport os\n" and third.suffix.startswith("\n\ndef total(a, b):")
    engine.finish(1, "")
    engine.finish(2, "")
    pos = T.Position(2, 0)
    notebook.change(T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(text_content=[
        T.NotebookDocumentCellContentChanges(
            document=T.VersionedTextDocumentIdentifier(uri=cells, version=next(notebook.version)),
            changes=[T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text="# both\n")])
        for cells in CELLS])))  # a replace across the cells: no one cursor to start at
    await pause()
    assert len(engine.runs) == 3 and ls.counters.started_ahead == 3


async def test_an_edit_in_a_notebook_cell_warms_its_prompt_and_a_removed_cell_is_forgotten():
    ls, engine = server(start_ahead="never", warm_ms=1)
    notebook = Notebook(ls)
    notebook.type_in_cell(1, 1, 4, "r")
    await pause()
    (request, _), = engine.runs
    assert request.warm and request.prefix == "import math\n\ndef total(a, b):\n    r"
    assert ls.counters.warmups == 1 and ls._warm_line[CELLS[1]] == 1
    engine.finish(0, "")
    notebook.change(T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(
        structure=T.NotebookDocumentCellChangeStructure(array=T.NotebookCellArrayChange(start=1, delete_count=1),
                                                        did_close=[T.TextDocumentIdentifier(CELLS[1])]))))
    assert CELLS[1] not in ls._warm_line and CELLS[1] not in ls._changed_at
    await pause()
    assert len(engine.runs) == 1  # a structure change is no keystroke: nothing warms


# -- a slow block answered with its whole lines first (completion.first_lines_ms) ------------

async def test_a_slow_block_answers_its_whole_lines_and_accepting_them_takes_the_rest():
    ls, engine = server(first_lines_ms=20)
    first = ask(ls, 1, 4)  # a blank indented line: a block
    await settle()
    (request, _), = engine.runs
    # what the engine says of the run once its prompt is prefilled (the record below reports it)
    request.run_info = {"prompt_tokens": 40, "reused_tokens": 30, "queue_ms": 2.0,
                        "prefill_ms": 5.0, "decode_start": time.perf_counter()}
    request.set_progress("result = a + b\n    ret", 7)  # one whole line written, the run goes on
    result = await asyncio.wait_for(first, 1)
    assert offered(result, "    ") == ["result = a + b"]
    assert not request.cancel.is_set() and ls.following[URI].request is request
    assert ls.counters.first_lines == 1 and ls.recent[-1]["stop_reason"] == "first_lines"
    record = ls.recent[-1]  # where its time went, as a finished run's record says
    assert (record["prompt_kind"], record["prompt_tokens"], record["reused_tokens"], record["generated_tokens"],
            record["queue_ms"], record["prefill_ms"]) == ("first-lines", 40, 30, 7, 2.0, 5.0)
    assert 0 <= record["decode_ms"] <= record["latency_ms"] + 1
    type_at(ls, 1, 4, "result = a + b")  # the user accepts the lines: typed along the run
    assert request.typed == "result = a + b" and not request.cancel.is_set()
    rest = ask(ls, 1, 18)
    await settle()
    assert not rest.done()  # it waits for the run
    engine.finish(0, WRITES)
    assert offered(await asyncio.wait_for(rest, 1), "    result = a + b") == [WRITES[len("result = a + b"):]]
    assert len(engine.runs) == 1 and ls.counters.followed == 1


async def test_a_block_answers_once_it_has_a_whole_line_and_a_quick_one_whole():
    ls, engine = server(first_lines_ms=10)
    first = ask(ls, 1, 4)
    await settle()
    (request, _), = engine.runs
    request.set_progress("resu")  # past the time, but no whole line yet: it waits
    await asyncio.sleep(0.05)
    assert not first.done()
    request.set_progress("result = a + b\n")
    assert offered(await asyncio.wait_for(first, 1), "    ") == ["result = a + b"]
    # a run done before the time answers whole, as without the setting
    ls2, engine2 = server(first_lines_ms=1000)
    second = ask(ls2, 1, 4)
    await settle()
    engine2.runs[0][0].set_progress("result = a + b\n    ret")
    engine2.finish(0, WRITES)
    assert offered(await asyncio.wait_for(second, 1), "    ") == [WRITES]
    assert ls2.counters.first_lines == 0 and URI not in ls2.following


async def test_the_block_finished_behind_its_first_lines_is_the_next_answer_there():
    ls, engine = server(first_lines_ms=1)
    first = ask(ls, 1, 4)
    await settle()
    engine.runs[0][0].set_progress("result = a + b\n")
    assert offered(await asyncio.wait_for(first, 1), "    ") == ["result = a + b"]
    engine.finish(0, WRITES)  # the user read the lines and did not type: the run ends behind them
    await settle()
    again = await asyncio.wait_for(ask(ls, 1, 4), 1)  # asked again there (a gesture, a cursor move back)
    assert offered(again, "    ") == [WRITES] and len(engine.runs) == 1


async def test_a_line_completion_and_the_setting_off_never_answer_early():
    text = "def total(a, b):\n    return f(a) + b\n"  # the cursor after "return ": code after it
    ls, engine = server(first_lines_ms=1)
    ls.workspace.put_text_document(T.TextDocumentItem(uri=URI, language_id="python", version=2, text=text))
    first = ask(ls, 1, 11)
    await settle()
    engine.runs[0][0].set_progress("g(a)\n    ")
    await asyncio.sleep(0.05)
    assert not first.done()
    engine.finish(0, "g(a) + ", "line_end")
    await asyncio.wait_for(first, 1)
    off, engine_off = server(first_lines_ms=0)
    second = ask(off, 1, 4)
    await settle()
    engine_off.runs[0][0].set_progress("result = a + b\n    ret")
    await asyncio.sleep(0.05)
    assert not second.done() and off.counters.first_lines == ls.counters.first_lines == 0
    engine_off.finish(0, WRITES)
    assert offered(await asyncio.wait_for(second, 1), "    ") == [WRITES]


def test_the_whole_lines_of_a_text_so_far():
    assert first_lines("result = a") == ""  # no line break yet
    assert first_lines("\n    x = 1\n    y") == "\n    x = 1"  # a block below a line opener
    assert first_lines("x = 1\r\n    y = 2\r\n") == "x = 1\n    y = 2"
    assert first_lines("\n\n") == "" and first_lines("x = 1\n\n\n    y") == "x = 1"
    # the stop rules keep a repeated line or block's first copy once it comes a third time
    assert first_lines("\n    a = 1\n    a = 1\n") == "\n    a = 1"
    assert first_lines("x\n    a = 1\n    b = 2\n    a = 1\n    b = 2\n    a") == "x\n    a = 1\n    b = 2"


def test_the_text_so_far_tells_its_listener_of_each_new_line_break_only():
    """Guards CompletionRequest.set_progress, the engine's news of a run's lines (what a request
    waiting for a slow block's first lines wakes on): once a line break is added, not at each
    token; a listener that fails is logged, the run's text still set."""
    calls = []
    request = CompletionRequest("def f():\n    ", "", on_line=lambda: calls.append(request.progress))
    for text in ("x", "x = 1", "x = 1\n", "x = 1\n    y", "x = 1\n    y = 2\n\n", "x = 1\n    y = 2\n\n"):
        request.set_progress(text)
    assert calls == ["x = 1\n", "x = 1\n    y = 2\n\n"]

    def broken():
        raise RuntimeError("gone")

    request = CompletionRequest("", "", on_line=broken)
    request.set_progress("a\n")
    assert request.progress == "a\n"
    plain = CompletionRequest("", "")
    plain.set_progress("a\nb")
    assert plain.progress == "a\nb"
