"""Routing between the indexes of a multi-root workspace (indexer/folders.py); the
daemon-level behaviour is in test_index_e2e.py."""

from __future__ import annotations

from pathlib import Path

from codecomplete.indexer.folders import Folders
from codecomplete.indexer.snippets import Snippet
from codecomplete.indexer.suffix import Continuation, Match


class FakeIndex:
    def __init__(self, root: Path, primary: bool, snippets=(), matches=()):
        self.root, self.primary = root, primary
        self._snippets, self._matches = list(snippets), list(matches)
        self.closed = False
        self.tokenizer = None
        self.drafts = None

    def set_tokenizer(self, tok):
        self.tokenizer = tok

    def close(self, timeout=0):
        self.closed = True

    def snippets(self, path, text, offset, *, limit, budget_ms):
        return self._snippets[:limit]

    def lookup(self, context, **kw):
        return list(self._matches)

    def stats(self):
        return {"root": str(self.root)}


def test_routing_overlap_limits_and_removal(tmp_path):
    a, b, c, d = (tmp_path / n for n in "abcd")
    for p in (a, b, c, d, a / "inner"):
        p.mkdir()
    made = []
    folders = Folders(lambda root, primary: made.append(FakeIndex(root, primary)) or made[-1], max_folders=3)
    folders.set_tokenizer("tok")
    first = folders.add(a)
    assert first.primary and folders.primary is first and first.tokenizer == "tok"
    assert folders.add(a) is first  # the same folder again
    assert folders.add(a / "inner") is None and folders.add(tmp_path) is None  # nested / containing
    assert folders.add(tmp_path / "missing") is None
    second = folders.add(b)
    assert not second.primary and second.tokenizer == "tok"
    assert folders.add(c) is not None and folders.add(d) is None  # max_folders
    assert folders.for_path(str(b / "x" / "y.py")) is second
    assert folders.for_path(str(a / "inner" / "z.py")) is first
    assert folders.for_path(str(tmp_path / "elsewhere.py")) is first  # outside all: the primary
    assert folders.for_path(str(tmp_path / "b2" / "x.py")) is first  # a sibling with b's name as prefix
    assert not folders.remove(a) and not first.closed  # the primary stays
    assert folders.remove(b) and second.closed and folders.for_path(str(b / "y.py")) is first
    folders.close_secondary()
    assert [i.root for i in folders.all()] == [Path(str(a))]


def test_snippets_put_definitions_first_and_name_other_folders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    own = [Snippet("x.py", 0, 2, "x", 3.0, "similar")]
    other = [Snippet("lib.py", 5, 7, "def f(): ...", 1.0, "definition of f"),
             Snippet("y.py", 0, 1, "y", 9.0, "similar")]
    table = {a: own, b: other}
    folders = Folders(lambda root, primary: FakeIndex(root, primary, snippets=table[Path(root)]))
    folders.add(a)
    folders.add(b)
    got = folders.snippets(str(a / "main.py"), "", 0, limit=3)
    assert [(s.path, s.reason) for s in got] == [("b/lib.py", "definition of f"), ("x.py", "similar"),
                                                ("b/y.py", "similar")]
    got = folders.snippets(str(b / "main.py"), "", 0, limit=2)  # b's file: b's own paths stay as they are
    assert [s.path for s in got] == ["lib.py", "y.py"]


def test_lookup_with_one_folder_is_its_own(tmp_path):
    m = Match(3, 1, [Continuation((1, 2), 1)], "repository")
    folders = Folders(lambda root, primary: FakeIndex(root, primary, matches=[m]))
    assert folders.lookup([1, 2, 3]) == []
    folders.add(tmp_path)
    assert folders.lookup([1, 2, 3]) == [m]
