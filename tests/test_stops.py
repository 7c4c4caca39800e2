"""Stop rules, on text alone."""

from codecomplete.model.stops import CompletionShape, StopRules


def rules(prefix, suffix, mode="auto", max_lines=12):
    return StopRules(CompletionShape.at_cursor(prefix, suffix, mode), max_lines)


def test_mid_line_is_single_line_and_stops_at_newline():
    r = rules("x = foo(", ")\ny = 2\n")
    assert not r.shape.multiline
    d = r.check("a, b)\nz = 3")
    assert d.stop and d.text == "a, b)" and d.reason == "line_end"


def test_block_opener_is_multi_line_and_stops_at_dedent():
    r = rules("def f(x):", "\n\nprint(f(1))\n")
    assert r.shape.multiline
    d = r.check("\n    y = x + 1\n    return y\nprint(3)\n")
    assert d.stop and d.reason == "block_end" and d.text == "\n    y = x + 1\n    return y"


def test_blank_line_at_indent_stops_below_it():
    r = rules("def f(x):\n    ", "")
    d = r.check("y = 1\n    return y\nx = 2\n")
    assert d.stop and d.text == "y = 1\n    return y"


def test_closing_brace_belongs_to_the_block():
    r = rules("function f() {", "\n")
    d = r.check("\n  return 1;\n}\nfunction g() {}\n")
    assert d.stop and d.text == "\n  return 1;\n}"


def test_repeating_the_suffix_stops_before_it():
    r = rules("def f(x):\n    ", "\n    return y\n")
    d = r.check("y = x * 2\n    return y\n")
    assert d.stop and d.reason == "suffix_overlap" and d.text == "y = x * 2"


def test_max_lines():
    r = rules("def f():\n    ", "", max_lines=2)
    d = r.check("a = 1\n    b = 2\n    c = 3\n    d = 4\n")
    assert d.stop and d.reason == "max_lines" and d.text.count("\n") == 1


def test_single_line_rewriting_the_rest_of_the_line_stops():
    r = rules("print(", ")")
    assert r.check("x)").stop
    assert not r.check("x").stop


def test_end_of_line_single_mode_offers_the_next_line():
    r = rules("x = 1", "")
    assert not r.shape.multiline
    assert not r.check("\n").stop
    d = r.check("\ny = 2\nz = 3")
    assert d.stop and d.text == "\ny = 2"
