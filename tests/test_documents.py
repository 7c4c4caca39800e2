"""Position conversion at the protocol edge."""

import pytest

from codecomplete.lsp.documents import PositionError, cursor_at, offset_at, position_at

TEXT = 'a😀b\nxyz\r\nq\rend'


@pytest.mark.parametrize("encoding,char,offset", [
    ("utf-16", 3, 2), ("utf-8", 5, 2), ("utf-32", 2, 2),  # just after the emoji
    ("utf-16", 4, 3), ("utf-8", 6, 3), ("utf-32", 3, 3),  # end of line 0
])
def test_offsets_count_code_units_of_the_encoding(encoding, char, offset):
    """Guards the emoji case: 2 utf-16 units, 4 utf-8 units, 1 code point."""
    assert offset_at(TEXT, 0, char, encoding) == offset
    assert position_at(TEXT, offset, encoding) == (0, char)


def test_all_three_line_endings_split_lines():
    assert offset_at(TEXT, 1, 0) == 4
    assert offset_at(TEXT, 2, 0) == 9
    assert offset_at(TEXT, 3, 2) == 13
    assert position_at(TEXT, 13) == (3, 2)


def test_character_past_the_line_end_clamps_to_it():
    """LSP: a character beyond the line length defaults back to the line length."""
    assert offset_at(TEXT, 1, 99) == 7


@pytest.mark.parametrize("line,char", [(4, 0), (-1, 0), (0, -1)])
def test_positions_outside_the_document_are_errors(line, char):
    with pytest.raises(PositionError):
        offset_at(TEXT, line, char)


def test_cursor_splits_prefix_suffix_and_finds_line_end():
    c = cursor_at(TEXT, 1, 1)
    assert (c.prefix, c.suffix) == ("a😀b\nx", "yz\r\nq\rend")
    assert TEXT[c.offset:c.line_end] == "yz"


@pytest.mark.parametrize("seed", range(3))
def test_newline_only_texts_take_the_counting_path_with_the_same_answers(seed):
    """Guards the fast path for texts without "\\r" (line starts found by str.count in
    blocks): it answers as the general line splitter does.  A "\\r" appended after the
    text sends the same text down the general path without moving any earlier line."""
    import random

    rng = random.Random(seed)
    pieces = ["a", "\n", "\U0001F600", "\u00e9", "\n\n", "xy", "b" * 70_000]  # lines across 64 kB blocks
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 30)))
        general = text + "\r"
        lines = text.count("\n")
        for line in range(lines + 1):
            assert offset_at(text, line, 3) == offset_at(general, line, 3)
            for encoding in ("utf-16", "utf-8"):
                assert cursor_at(text, line, 2, encoding).line_start == cursor_at(general, line, 2, encoding).line_start
        with pytest.raises(PositionError, match=f"{lines + 1} lines"):
            offset_at(text, lines + 1, 0)
        for offset in rng.sample(range(len(text) + 1), min(len(text) + 1, 5)):
            assert position_at(text, offset) == position_at(general, offset)


def test_an_edit_past_the_end_lands_at_the_end_and_is_logged(caplog):
    """A client out of step (an edit below the last line) gets pygls's lenient answer, the text
    at the end, and a warning naming the document, so a drifted copy can be traced in the log."""
    from lsprotocol import types as T

    from codecomplete.lsp.workspace import LspWorkspace

    ws = LspWorkspace(None, T.TextDocumentSyncKind.Incremental)
    uri = "file:///w/a.py"
    ws.put_text_document(T.TextDocumentItem(uri=uri, language_id="python", version=1, text="x = 1\ny = "))
    edit = T.TextDocumentContentChangePartial(range=T.Range(T.Position(1, 4), T.Position(1, 4)), text="2")
    ws.update_text_document(T.VersionedTextDocumentIdentifier(uri=uri, version=2), edit)
    assert not caplog.records
    past = T.TextDocumentContentChangePartial(range=T.Range(T.Position(50, 0), T.Position(60, 3)), text="\nz")
    with caplog.at_level("WARNING"):
        ws.update_text_document(T.VersionedTextDocumentIdentifier(uri=uri, version=3), past)
    assert ws.get_text_document(uri).source == "x = 1\ny = 2\nz"
    assert any(uri in r.getMessage() and "line 50" in r.getMessage() for r in caplog.records)
