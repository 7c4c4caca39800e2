"""pygls's workspace with edits applied at LSP's own line breaks.

pygls splits a document into lines with ``str.splitlines``, which also breaks at form feed,
vertical tab, U+2028 and a few more characters; LSP breaks lines only at ``\\n``, ``\\r\\n``
and ``\\r``.  In a file with a form feed (GNU C sources, Python's standard library) or a
U+2028 in a string, every incremental edit below that character landed on the wrong line,
and the daemon's copy of the buffer drifted from the editor's for good.  Here an edit is
spliced at the offsets ``documents.offset_at`` computes, the same conversion the
completion requests use, which also skips pygls's split of the whole document on every
keystroke (12 ms for 900 kB).
"""

from __future__ import annotations

import logging
from urllib.parse import unquote

from lsprotocol import types
from pygls.workspace import TextDocument, Workspace

from .documents import PositionError, encoding_name, offset_at

log = logging.getLogger(__name__)


def _offset(text: str, position: types.Position, encoding: str, uri: str = "") -> int:
    """A lenient offset for an edit: a line past the end is the end of the document (logged: the
    client's copy and this one may differ from here on, until its next full sync)."""
    try:
        return offset_at(text, max(position.line, 0), max(position.character, 0), encoding)
    except PositionError as e:
        log.warning("edit of %s at line %d: %s; applied at the end of the document", uri, position.line, e)
        return len(text)


class LspTextDocument(TextDocument):
    def _apply_incremental_change(self, change: types.TextDocumentContentChangePartial) -> None:
        text = self.source
        encoding = encoding_name(self.position_codec.encoding)
        start = _offset(text, change.range.start, encoding, self.uri)
        end = max(start, _offset(text, change.range.end, encoding, self.uri))
        self._source = text[:start] + change.text + text[end:]


class LspWorkspace(Workspace):
    def _create_text_document(self, doc_uri, source=None, version=None, language_id=None) -> TextDocument:
        return LspTextDocument(doc_uri, source=source, version=version, language_id=language_id,
                               sync_kind=self._sync_kind, position_codec=self._position_codec)

    def is_open(self, uri: str) -> bool:
        return unquote(uri) in self._text_documents

    def update_text_document(self, text_doc: types.VersionedTextDocumentIdentifier,
                             change: types.TextDocumentContentChangeEvent) -> None:
        """An edit of an open document; one of a document the client never opened (a client
        bug, or a didOpen lost on the way) is logged and ignored instead of failing in pygls
        with a KeyError: its text is unknown, and the file on disk still answers for it."""
        if not self.is_open(text_doc.uri):
            log.warning("didChange for %s, which is not open (no didOpen): ignored", text_doc.uri)
            return
        super().update_text_document(text_doc, change)


def lsp_workspace(like: Workspace, sync_kind) -> LspWorkspace:
    """The workspace pygls made at ``initialize`` (``like``), as an LspWorkspace."""
    return LspWorkspace(like.root_uri, sync_kind, list(like.folders.values()), like.position_encoding)
