"""Replaying a session's documents as Jupyter notebooks (``codecomplete-daemon replay
--as-notebooks``): each document opened is synced as a notebook of code cells, as VS Code's
Jupyter does (``notebookDocument/didOpen``, ``didChange``, ``didClose``), and each of the
session's edits, requests and cursor reports goes to the cell it falls in, at the cell's own
line.  The cells partition the document's text at its top-level paragraphs (a line that is
not indented and follows a blank line starts a cell), so the cells together are the document
exactly and a cell's prompt (the cells around it, blank lines between) is the document's
text; an edit that spans cells merges them into one (a structure change, as a client sends
when cells are joined).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from .sessions import apply_change

_CELL_IDS = itertools.count()


def split_cells(text: str) -> list[str]:
    """``text`` in cells: a line that is not blank or indented (nor a closing bracket) and
    follows a blank line starts a cell; every cell but the last ends with a line break."""
    lines = text.splitlines(keepends=True)
    cells: list[str] = []
    start = 0
    for i in range(1, len(lines)):
        line = lines[i]
        if line.strip() and not line[0].isspace() and line[0] not in ")]}" and not lines[i - 1].strip():
            cells.append("".join(lines[start:i]))
            start = i
    cells.append("".join(lines[start:]))
    return cells


def _lines(text: str) -> int:
    return text.count("\n")


@dataclass
class NotebookView:
    """One document as a notebook: its cells' uris and texts, in order (their join is the
    document's text)."""

    uri: str  # the notebook's (the document's path with .ipynb)
    language: str
    cells: list[list[str]] = field(default_factory=list)  # [cell uri, text]
    version: int = 1
    merges: int = 0  # edits that spanned cells (merged into one)

    @classmethod
    def open(cls, doc_uri: str, text: str, language: str) -> "NotebookView":
        path = doc_uri[len("file://"):] if doc_uri.startswith("file://") else doc_uri
        view = cls(Path(path).with_suffix(".ipynb").as_uri() if doc_uri.startswith("file://") else doc_uri + ".ipynb",
                   language)
        view.cells = [[view._cell_uri(), t] for t in split_cells(text)]
        return view

    def _cell_uri(self) -> str:
        # VS Code's form: the notebook's path, the cell in the fragment
        path = self.uri[len("file://"):] if self.uri.startswith("file://") else self.uri
        return f"vscode-notebook-cell:{path}#W{next(_CELL_IDS)}sZmlsZQ%3D%3D"

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.cells)

    def locate(self, line: int) -> tuple[int, int]:
        """The cell holding the document's ``line`` and that line's number in the cell (a line
        past the end: the last cell's)."""
        first = 0
        for i, (_, text) in enumerate(self.cells):
            n = _lines(text)
            if line < first + n or i == len(self.cells) - 1:
                return i, line - first
            first += n
        raise AssertionError("no cells")

    def at(self, line: int) -> tuple[str, int]:
        """The uri of the cell holding the document's ``line``, and that line's number there."""
        cell, local = self.locate(line)
        return self.cells[cell][0], local

    def open_params(self):
        from lsprotocol import types as T

        return T.DidOpenNotebookDocumentParams(
            notebook_document=T.NotebookDocument(uri=self.uri, notebook_type="jupyter-notebook", version=self.version,
                                                 cells=[T.NotebookCell(kind=T.NotebookCellKind.Code, document=u)
                                                        for u, _ in self.cells]),
            cell_text_documents=[T.TextDocumentItem(uri=u, language_id=self.language, version=1, text=t)
                                 for u, t in self.cells])

    def close_params(self):
        from lsprotocol import types as T

        return T.DidCloseNotebookDocumentParams(
            notebook_document=T.NotebookDocumentIdentifier(self.uri),
            cell_text_documents=[T.TextDocumentIdentifier(u) for u, _ in self.cells])

    def change(self, ch: dict):
        """One of the session's changes (LSP's, in the document's lines) as the notebook's
        didChange: within one cell, that cell's text change at its own lines; over several
        cells (or the whole document), those cells replaced by one holding their changed text."""
        from lsprotocol import types as T

        self.version += 1
        r = ch.get("range")
        if r is None:  # the whole text
            first, last, merged = 0, len(self.cells) - 1, ch["text"]
        else:
            first, start_line = self.locate(r["start"]["line"])
            last, end_line = self.locate(r["end"]["line"])
            if last > first and end_line == 0 and r["end"]["character"] == 0:
                last, end_line = last - 1, _lines(self.cells[last - 1][1])  # the end of the cell before
            if first == last:
                uri, text = self.cells[first]
                local = {"start": {"line": start_line, "character": r["start"]["character"]},
                         "end": {"line": end_line, "character": r["end"]["character"]}}
                changed = apply_change(text, {"range": local, "text": ch["text"]})
                if changed.endswith("\n") or first == len(self.cells) - 1:
                    self.cells[first][1] = changed
                    return T.DidChangeNotebookDocumentParams(
                        notebook_document=T.VersionedNotebookDocumentIdentifier(version=self.version, uri=self.uri),
                        change=T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(text_content=[
                            T.NotebookDocumentCellContentChanges(
                                document=T.VersionedTextDocumentIdentifier(uri=uri, version=self.version),
                                changes=[T.TextDocumentContentChangePartial(range=T.Range(
                                    T.Position(start_line, r["start"]["character"]),
                                    T.Position(end_line, r["end"]["character"])), text=ch["text"])])])))
            # the cells the range spans become one (and the next, where the last would lose its
            # line break: a cell's last line is the document's)
            lines_before = sum(_lines(t) for _, t in self.cells[:first])
            local = {"start": {"line": r["start"]["line"] - lines_before, "character": r["start"]["character"]},
                     "end": {"line": r["end"]["line"] - lines_before, "character": r["end"]["character"]}}
            while True:
                merged = apply_change("".join(t for _, t in self.cells[first:last + 1]),
                                      {"range": local, "text": ch["text"]})
                if merged.endswith("\n") or last == len(self.cells) - 1:
                    break
                last += 1
        self.merges += 1
        gone = self.cells[first:last + 1]
        new = [self._cell_uri(), merged]
        self.cells[first:last + 1] = [new]
        return T.DidChangeNotebookDocumentParams(
            notebook_document=T.VersionedNotebookDocumentIdentifier(version=self.version, uri=self.uri),
            change=T.NotebookDocumentChangeEvent(cells=T.NotebookDocumentCellChanges(
                structure=T.NotebookDocumentCellChangeStructure(
                    array=T.NotebookCellArrayChange(start=first, delete_count=len(gone),
                                                    cells=[T.NotebookCell(T.NotebookCellKind.Code, new[0])]),
                    did_open=[T.TextDocumentItem(uri=new[0], language_id=self.language, version=1, text=merged)],
                    did_close=[T.TextDocumentIdentifier(u) for u, _ in gone]))))
