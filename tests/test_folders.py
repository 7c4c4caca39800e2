"""Routing between the indexes of a multi-root workspace (indexer/folders.py); the
daemon-level behaviour is in test_index_e2e.py."""

from __future__ import annotations

from pathlib import Path

from codecomplete.indexer.folders import Folders
from codecomplete.indexer.snippets import Snippet
from codecomplete.indexer.suffix import Continuation, Match


class FakeIndex:
    def __init__(self, root: Path, primary: bool, snippets=(), defined=(), matches=()):
        self.root, self.primary = root, primary
        self._defined = set(defined)
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

    def defines(self, names):
        return self._defined & set(names)

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


def test_snippets_rank_other_folders_definitions_by_use(tmp_path):
    """Another folder's definition of a name the file calls comes before the own folder's
    similar chunks; of a name merely used, after them; of a name the own folder defines,
    never."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    own = [Snippet("x.py", 0, 2, "x", 3.0, "similar")]
    other = [Snippet("lib.py", 5, 7, "def total(): ...", 1.0, "definition of total"),
             Snippet("val.py", 1, 2, "def value(): ...", 1.0, "definition of value"),
             Snippet("mine.py", 1, 2, "def helper(): ...", 1.0, "definition of helper"),
             Snippet("it.py", 1, 2, "def items(): ...", 1.0, "definition of items"),
             Snippet("y.py", 0, 1, "y", 9.0, "similar")]
    table = {a: (own, {"helper"}), b: (other, set())}
    folders = Folders(lambda root, primary: FakeIndex(root, primary, *table[Path(root)]))
    folders.add(a)
    folders.add(b)
    text = "from lib import total\nvalue = 3\nhelper(value)\nfor k in d.items():\n    x = total("
    got = folders.snippets(str(a / "main.py"), text, len(text), limit=6)
    assert [(s.path, s.reason) for s in got] == [
        ("b/lib.py", "definition of total"), ("x.py", "similar"), ("b/val.py", "definition of value"),
        ("b/it.py", "definition of items"), ("b/y.py", "similar")]
    got = folders.snippets(str(b / "main.py"), text, len(text), limit=2)  # b's own file: its paths stay
    assert [s.path for s in got] == ["lib.py", "val.py"]


def test_lookup_with_one_folder_is_its_own(tmp_path):
    m = Match(3, 1, [Continuation((1, 2), 1)], "repository")
    folders = Folders(lambda root, primary: FakeIndex(root, primary, matches=[m]))
    assert folders.lookup([1, 2, 3]) == []
    folders.add(tmp_path)
    assert folders.lookup([1, 2, 3]) == [m]
