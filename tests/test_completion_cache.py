"""The completion cache (lsp/cache.py): what it keeps, under which key, for how long."""

from __future__ import annotations

from codecomplete.lsp.cache import CompletionCache
from codecomplete.model.api import Completion

SHAPE = ("auto", 128, 8, 1000, 1)


def made(text: str, reason: str = "line_end", **kw) -> Completion:
    return Completion(text, reason, prompt_tokens=40, generated_tokens=5, reused_tokens=30,
                      prompt_kind="efim", forward_passes=3, timings={"decode_ms": 9.0}, **kw)


def test_the_key_is_every_input_of_the_prompt():
    k = CompletionCache.key
    base = k("file:///a.py", "def f(", ")", "", SHAPE)
    assert base == k("file:///a.py", "def f(", ")", "", SHAPE)
    others = [k("file:///b.py", "def f(", ")", "", SHAPE), k("file:///a.py", "def g(", ")", "", SHAPE),
              k("file:///a.py", "def f(", "", "", SHAPE), k("file:///a.py", "def f(", ")", "# ctx", SHAPE),
              k("file:///a.py", "def f(", ")", "", SHAPE[:-1] + (3,)),
              # no two fields can be shifted into one another
              k("file:///a.py", "def f", "()", "", SHAPE), k("file:///a.py", "def f(", "", ")", SHAPE)]
    assert len({base, *others}) == len(others) + 1


def test_a_hit_is_the_completion_made_marked_as_nothing_run():
    cache = CompletionCache(8)
    key = cache.key("u", "p", "s", "", SHAPE)
    assert cache.get(key) is None
    original = made("x = 1", alternatives=[made("x = 2", "eos")])
    assert cache.put(key, original)
    hit = cache.get(key)
    assert hit.texts == ["x = 1", "x = 2"] and hit.stop_reason == "line_end"
    assert hit.prompt_kind == "cached" and hit.alternatives[0].prompt_kind == "cached"
    assert (hit.prompt_tokens, hit.generated_tokens, hit.reused_tokens, hit.forward_passes, hit.timings) == (
        0, 0, 0, 0, {})
    assert original.prompt_tokens == 40 and original.prompt_kind == "efim"  # the entry itself is kept as made
    assert cache.hits == 1


def test_only_completions_that_would_be_the_same_again_are_kept():
    cache = CompletionCache(8)
    key = cache.key("u", "p", "s", "", SHAPE)
    for reason in ("time_budget", "cancelled", "error", "model_unavailable", "something_new"):
        assert not cache.put(key, made("x", reason))
    assert not cache.put(key, made("x", error="boom"))
    assert not cache.put(key, made("x", alternatives=[made("y", "time_budget")]))  # a fork ran out of time
    assert cache.get(key) is None and len(cache) == 0
    assert cache.put(key, made("", "eos"))  # nothing to offer is an answer too
    assert cache.get(key).texts == []


def test_least_recently_used_entries_go_first_and_a_closed_document_takes_its_own():
    cache = CompletionCache(2)
    a, b, c = (cache.key(u, "p", "s", "", SHAPE) for u in ("file:///a", "file:///b", "file:///c"))
    cache.put(a, made("a"))
    cache.put(b, made("b"))
    assert cache.get(a).text == "a"  # a is now the most recent
    cache.put(c, made("c"))
    assert cache.get(b) is None and cache.get(a).text == "a" and cache.get(c).text == "c"
    cache.drop("file:///a")
    assert cache.get(a) is None and cache.get(c).text == "c"
    cache.resize(0)
    assert len(cache) == 0 and not cache.put(a, made("a")) and cache.get(a) is None


def test_a_completion_whose_request_started_before_a_clear_is_not_kept():
    """A request in flight while the settings changed (the cache was emptied; the model may
    be another) must not put its completion in after."""
    cache = CompletionCache(8)
    key = cache.key("u", "p", "s", "", SHAPE)
    started = cache.generation
    cache.clear()
    assert not cache.put(key, made("old model's"), started) and cache.get(key) is None
    assert cache.put(key, made("new model's"), cache.generation) and cache.get(key).text == "new model's"


def test_typing_through_a_line_break_in_a_crlf_buffer_keeps_the_completion():
    """Completions break lines with \\n; a CRLF buffer's typed break is \\r\\n and still matches."""
    from codecomplete.daemon.config import Config
    from codecomplete.lsp.server import CodecompleteServer, Shown

    server = CodecompleteServer(None, Config())
    uri = "file:///a.py"
    prefix = "def f(x):\r\n"
    server.shown[uri] = Shown(prefix, "\r\n", made("    y = x + 1\n    return y", reason="block_end"))
    through = server._typed_through(uri, prefix + "    y = x + 1\r\n", "\r\n")
    assert through is not None and through[0].text == "    return y" and through[1] == 0
    assert server._typed_through(uri, prefix + "    y = x + 2\r\n", "\r\n") is None


def test_typing_through_brackets_the_editor_closed_keeps_the_completion():
    """An editor that closes pairs (VS Code by default, Neovim's autopairs) puts ``)`` after the
    cursor as the user types ``(``: typing through goes on, and the rest replaces those closers,
    so accepting it gives the text the completion would have given."""
    from codecomplete.daemon.config import Config
    from codecomplete.lsp.documents import cursor_at
    from codecomplete.lsp.server import Answer, CodecompleteServer, Shown

    server = CodecompleteServer(None, Config())
    uri = "file:///a.js"
    prefix, suffix = "const x = ", ";\n"
    shown = 'items.map((v) => f(v, "a"))'
    server.shown[uri] = Shown(prefix, suffix, made(shown))
    for typed, closers in [("items.map(", ")"), ("items.map((v", "))"), ("items.map((v) => f(v, \"", "\"))"),
                           ("items.map((v) => f(v, \"a\"", "))"), ("items.map(", "")]:
        through = server._typed_through(uri, prefix + typed, closers + suffix)
        assert through is not None, typed
        rest, covers = through
        assert rest.text == shown[len(typed):] and covers == len(closers) and rest.prompt_kind == "typed-through"
        # the item: its range runs from the line's start over the closers; accepting it gives the whole text
        text = prefix + typed + closers + suffix
        cursor = cursor_at(text, 0, len(prefix + typed))
        (item,) = server._items(Answer("c1", uri, text, cursor, rest, "utf-16", None, covers))
        assert (item.range.start.character, item.range.end.character) == (0, len(prefix + typed + closers))
        assert item.insert_text == prefix + shown
        # its accept command carries the line after the cursor, split at the range's end (what a
        # client whose item predates its last keystrokes compares with the line it has then)
        assert item.command.arguments[0] == {"completionId": "c1", "uri": uri, "replaces": closers,
                                             "after": ";"}
    # a line with more than AFTER_CHARS after the range: nothing of it is sent
    from codecomplete.lsp.server import AFTER_CHARS
    text = prefix + "items.map(" + ")" + " " * AFTER_CHARS + ";"
    cursor = cursor_at(text, 0, len(prefix + "items.map("))
    (item,) = server._items(Answer("c2", uri, text, cursor, made(shown[len("items.map("):]), "utf-16", None, 1))
    assert item.command.arguments[0] == {"completionId": "c2", "uri": uri}
    # what the typed text leaves open, innermost first: inside quotes only the quote closes
    from codecomplete.model.stops import open_pairs
    assert open_pairs('f(g[1], {"a": "(') == '"})'
    assert open_pairs('f("a\\"(", x') == ")"  # an escaped quote and a bracket inside the string
    assert open_pairs("x) + (y") == ")"  # a closer of what was opened before the typed text
    assert open_pairs("done()") == ""
    # what was put after the cursor is not what the typed text left open: the model runs again
    for typed, after in [("items.map(", "]"), ("items.map(", "x)"), ("items.map(", "))"), ("items", ")")]:
        assert server._typed_through(uri, prefix + typed, after + suffix) is None, (typed, after)


def test_an_item_covers_the_closers_after_the_cursor_only_where_the_text_closes_them():
    """The item's range reaches over the code after the cursor where the completion rewrote it:
    for ``print(|)`` the text ``len(x))`` (it closes print's ``(``) but not ``len(x)``, which
    goes before that ``)``; ``RuntimeError):`` rewrites the ``)`` of ``class Exit(|)``."""
    from codecomplete.daemon.config import Config
    from codecomplete.lsp.documents import cursor_at
    from codecomplete.lsp.server import Answer, CodecompleteServer

    server = CodecompleteServer(None, Config())
    uri = "file:///a.py"
    for line, completion, covered in [("    print(", "len(x))", True), ("    print(", "len(x)", False),
                                      ("class Exit(", "RuntimeError):", True)]:
        text = "import os\n" + line + ")\nx = 1\n"
        cursor = cursor_at(text, 1, len(line))
        (item,) = server._items(Answer("c1", uri, text, cursor, made(completion), "utf-16", None))
        assert item.insert_text == line + completion
        assert item.range.end.character == len(line) + covered, (line, completion)
