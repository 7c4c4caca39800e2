"""Start the real daemon as a subprocess and talk to it with pytest-lsp's client."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from lsprotocol import types as T
from pytest_lsp import LanguageClient, make_test_lsp_client

from codecomplete.lsp.server import plain


# A test that compares a daemon's completion with a reference engine's wants the whole of it;
# with completion.first_lines_ms (on by default) a multi-line completion still being written
# 150 ms after its request is answered with its first lines, which depends on the machine's speed.
WHOLE_COMPLETIONS = ("--set", "completion.first_lines_ms=0")


async def start_daemon(repo: Path, model: Path, *, encodings: list[str] | None = None,
                       init_options: dict | None = None, extra_args: tuple[str, ...] = (),
                       first_lines_ms: int | None = 0,
                       inline: bool = True, markdown: bool = False, progress: bool = False,
                       folders: list[Path] | None = None, registrations: list | None = None,
                       registration_gate: asyncio.Event | None = None) -> LanguageClient:
    """``inline``: the client announces inline-completion support (False: a client that
    only has the completion menu, as Neovim 0.11 with nvim-cmp or Helix).  ``first_lines_ms``:
    completion.first_lines_ms on the daemon's command line (over any other source; None: the
    daemon's own settings)."""
    client = make_test_lsp_client()
    if registrations is not None:  # the client watches files for the server when asked
        @client.feature(T.CLIENT_REGISTER_CAPABILITY)
        async def register(params: T.RegistrationParams):
            if registration_gate is not None:  # a client slow to answer
                await registration_gate.wait()
            registrations.extend(params.registrations)
            return None
    env = dict(os.environ)
    pin = ("--set", f"completion.first_lines_ms={first_lines_ms}") if first_lines_ms is not None else ()
    await client.start_io(sys.executable, "-m", "codecomplete.daemon", "--repo", str(repo),
                          "--model", str(model), "--dtype", "float32", *pin, *extra_args, env=env)
    general = T.GeneralClientCapabilities(position_encodings=encodings) if encodings else None
    caps = T.ClientCapabilities(
        general=general,
        text_document=T.TextDocumentClientCapabilities(
            synchronization=T.TextDocumentSyncClientCapabilities(did_save=True),
            inline_completion=T.InlineCompletionClientCapabilities() if inline else None,
            completion=T.CompletionClientCapabilities(completion_item=T.ClientCompletionItemOptions(
                documentation_format=[T.MarkupKind.Markdown, T.MarkupKind.PlainText])) if markdown else None),
        workspace=T.WorkspaceClientCapabilities(did_change_watched_files=T.DidChangeWatchedFilesClientCapabilities(
            dynamic_registration=True)) if registrations is not None else None,
        notebook_document=T.NotebookDocumentClientCapabilities(  # as VS Code's client
            synchronization=T.NotebookDocumentSyncClientCapabilities()),
        window=T.WindowClientCapabilities(show_message=T.ShowMessageRequestClientCapabilities(),
                                          work_done_progress=progress or None))
    client.initialized_with = await client.initialize_session(T.InitializeParams(
        capabilities=caps, root_uri=repo.as_uri(), initialization_options=init_options,
        workspace_folders=[T.WorkspaceFolder(uri=f.as_uri(), name=f.name) for f in folders] if folders else None,
        client_info=T.ClientInfo(name="pytest-lsp")))
    return client


def open_doc(client: LanguageClient, uri: str, text: str, version: int = 1, language: str = "python") -> None:
    client.text_document_did_open(T.DidOpenTextDocumentParams(
        T.TextDocumentItem(uri=uri, language_id=language, version=version, text=text)))


def insert(client: LanguageClient, uri: str, version: int, line: int, char: int, text: str) -> None:
    pos = T.Position(line, char)
    client.text_document_did_change(T.DidChangeTextDocumentParams(
        T.VersionedTextDocumentIdentifier(uri=uri, version=version),
        [T.TextDocumentContentChangePartial(range=T.Range(pos, pos), text=text)]))


def inline_params(uri: str, line: int, char: int, invoked: bool = False) -> T.InlineCompletionParams:
    kind = T.InlineCompletionTriggerKind.Invoked if invoked else T.InlineCompletionTriggerKind.Automatic
    return T.InlineCompletionParams(context=T.InlineCompletionContext(trigger_kind=kind),
                                    text_document=T.TextDocumentIdentifier(uri=uri),
                                    position=T.Position(line, char))


async def complete(client: LanguageClient, uri: str, line: int, char: int, invoked: bool = False):
    result = await client.text_document_inline_completion_async(inline_params(uri, line, char, invoked))
    return list(result.items if isinstance(result, T.InlineCompletionList) else (result or []))


async def stats(client: LanguageClient, recent: bool = False, config: bool = False) -> dict:
    params = {**({"recent": True} if recent else {}), **({"config": True} if config else {})}
    return plain(await client.protocol.send_request_async("codecomplete/stats", params))


async def send_raw(client: LanguageClient, body: bytes, msg_id: str | None = None):
    """Write one framed message as given (valid or not); if ``msg_id`` is set, wait
    for the response to that id and return it (raising on an error response)."""
    from concurrent.futures import Future

    fut: Future | None = None
    if msg_id is not None:
        fut = Future()
        client.protocol._request_futures[msg_id] = fut
    client._server.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await client._server.stdin.drain()
    if fut is not None:
        return await asyncio.wrap_future(fut)


async def menu(client: LanguageClient, uri: str, line: int, char: int) -> T.CompletionList:
    """textDocument/completion, as a completion-menu client asks while the user types."""
    result = await client.text_document_completion_async(T.CompletionParams(
        text_document=T.TextDocumentIdentifier(uri=uri), position=T.Position(line, char),
        context=T.CompletionContext(trigger_kind=T.CompletionTriggerKind.Invoked)))
    assert isinstance(result, T.CompletionList), result
    return result
