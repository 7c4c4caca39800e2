"""Stop rules, on text alone."""

import pytest

from codecomplete.model import stops
from codecomplete.model.stops import CompletionShape, StopRules, starts_definition


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


def test_a_line_repeated_three_times_keeps_its_first_copy():
    r = rules("def f(p):\n    ", "")
    loop = "p.items('a')\n    p.items('b')\n    p.items('b')\n    p.items('b')\n"
    d = r.check(loop + "    p.it")
    assert d.stop and d.reason == "repetition" and d.text == "p.items('a')\n    p.items('b')"
    # two copies are code, not yet a loop
    assert not r.check("p.items('a')\n    p.items('b')\n    p.items('b')\n    p.it").stop


def test_the_cursor_line_counts_as_the_first_copy():
    r = rules("def f(mp):\n    ", "")
    d = r.check("assert g(mp)\n    assert g(mp)\n    assert g(mp)\n")
    assert d.stop and d.reason == "repetition" and d.text == "assert g(mp)"


def test_a_repeated_block_keeps_one_copy_and_blank_lines_between_copies_do_not_hide_it():
    r = rules("def f(x):\n    ", "")
    block = "if x is not None:\n        y[x] = x\n\n    "
    d = r.check("y = {}\n    " + block + block.rstrip(" ") + "    ret")
    assert d.stop and d.reason == "repetition"
    assert d.text == "y = {}\n    if x is not None:\n        y[x] = x"


def test_nearly_equal_blocks_three_times_keep_their_first_copy():
    """A block of 2-4 lines whose lines each differ a little from the block before (what the
    default model wrote after ``for name in filenames:``) is a loop at its third copy; two such
    copies, or blocks whose short lines differ (a dispatch chain's ``return 1`` / ``return 2``),
    are code."""
    from codecomplete.model import stops

    r = rules("def f(filenames):\n    for name in filenames:\n        ", "")
    block = 'if name.startswith("{}"):\n            continue\n        '
    copies = [block.format(w) for w in ("tree", "tree_", "tree_tr")]
    d = r.check("".join(copies) + "if")
    assert d.stop and d.reason == "repetition" and d.text == copies[0].rstrip()
    assert not r.check("".join(copies[:2]) + "if").stop
    chain = "".join(f'if x == "{c}":\n            return {i}\n        ' for i, c in enumerate("abcd"))
    assert not r.check(chain + "if").stop
    # one line of each copy changed more than a tenth is no loop either
    far = "".join(block.format(w) for w in ("tree", "forest_of_trees", "tree_tr"))
    assert not r.check(far + "if").stop
    # blank lines between copies do not hide it; NEAR_BLOCK_COPIES = 0 turns the rule off
    spaced = "x = 1\n        " + "\n        ".join(copies) + "if"
    assert r.check(spaced).text == "x = 1\n        " + copies[0].rstrip()
    old, stops.NEAR_BLOCK_COPIES = stops.NEAR_BLOCK_COPIES, 0
    try:
        assert not rules("def f(filenames):\n    for name in filenames:\n        ", "").check(
            "".join(copies) + "if").stop
    finally:
        stops.NEAR_BLOCK_COPIES = old


def test_the_same_line_at_another_indentation_is_no_loop():
    r = rules("def f():\n    ", "")
    text = "if a:\n        if b:\n            g()\n        g()\n    g()\n"
    assert r.check(text).reason != "repetition"


def test_a_run_of_nearly_equal_lines_keeps_its_first():
    r = rules("def f():\n    ", "")
    text = "".join(f"# cryptography < 1.{i}.0\n    " for i in range(4, 10))
    d = r.check("x = 1\n    " + text + "#")
    assert d.stop and d.reason == "repetition" and d.text == "x = 1\n    # cryptography < 1.4.0"
    # five such lines are not yet a loop, nor are lines whose values differ more
    assert not r.check("x = 1\n    " + "".join(f"# cryptography < 1.{i}.0\n    " for i in range(4, 9))).stop
    assert not r.check("".join(f"assert parse('{w}') == {w!r}\n    " for w in
                               ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta"))).stop


def test_a_budget_cut_drops_the_partial_last_line_of_a_block():
    r = rules("def f(x):\n    ", "")
    text = "y = x + 1\n    z = y * 2\n    return fo"
    assert r.finish(text, budget_cut=True) == "y = x + 1\n    z = y * 2"
    assert r.finish(text) == text  # an end token: the last line is whole
    assert r.finish("y = x + 1\n    z = y", budget_cut=True) == "y = x + 1"
    # at the end of a block opener the first line is empty: its partial next line stays
    opener = rules("def f(x):", "\n")
    assert opener.finish("\n    return fo", budget_cut=True) == "\n    return fo"
    single = rules("x = foo(", ")\n")
    assert single.finish("a, b, c", budget_cut=True) == "a, b, c"


def test_a_character_cut_between_its_tokens_is_dropped():
    """Byte-level tokens split CJK characters and emoji (SmolLM2's tokenizer gives ``# 日本``
    then ``# 日本\ufffd`` for the first half of ``語``): a budget that ends there would offer
    U+FFFD, which accepting inserts into the file."""
    comment = rules("def f(x):\n    ", "")
    assert comment.finish("# 日本\ufffd", budget_cut=True) == "# 日本"
    assert comment.finish("return '\ufffd\ufffd", budget_cut=True) == "return '"
    assert comment.finish("x = 1\n    # \ufffd", budget_cut=True) == "x = 1"  # then the cut line goes too
    assert comment.finish("# 日本語", budget_cut=True) == "# 日本語"
    single = rules("s = ", "\n")
    assert single.finish('"\ufffd', budget_cut=True) == '"'


def first_stop(r, text):
    """Feed ``text`` as decoding does (the check after every character) and return the
    first decision that stops, and how much of the text had come."""
    for i in range(1, len(text) + 1):
        d = r.check(text[:i])
        if d.stop:
            return d, i
    return None, len(text)


def test_a_line_that_runs_away_stops_after_its_first_copy():
    r = rules("import os\n\ndef f():\n    return os.", "")
    d, seen = first_stop(r, "path.getsize(os.path.getsize(os.path.getsize(os.path.getsize(os.path")
    assert d.reason == "repetition" and r.finish(d.text) == "path.getsize("
    assert seen == len("path.getsize(os.path.getsize(os.path.getsize(os.")  # three copies: no more
    # the same as a single-line completion on the next line, and after a line of code in a block
    single = rules("x = 1", "\n")
    d, _ = first_stop(single, "\ny = compute(alpha_value(alpha_value(alpha_value(alpha_value(")
    assert r.finish(d.text) == "\ny = compute(alpha_value("  # the copy kept starts at a word
    block = rules("def f():\n    ", "")
    d, _ = first_stop(block, "x = 1\n    y = g(other_name, other_name, other_name, other_name, ")
    assert d.reason == "repetition" and d.text == "x = 1"  # the line the loop took goes, as a cut line


def test_short_units_need_six_copies_and_runs_of_one_or_two_characters_are_no_loop():
    assert not first_stop(rules("from typing import ", "\n"), "Any, Any, Any, Any, Any")[0]
    d, _ = first_stop(rules("from typing import ", "\n"), "Any, Any, Any, Any, Any, Any, Any")
    assert d.reason == "repetition" and d.text.rstrip() == "Any,"
    for text in ('"' + "-" * 60 + '"', "# " + "=-" * 30, "0x" + "0" * 40, "[" + ", ".join(["0"] * 5) + "]"):
        assert not first_stop(rules("x = ", "\n"), text)[0], text


def test_the_users_own_repetition_is_continued_until_the_model_repeats_it_alone():
    typed = "row = [0, 0, 0, 0, 0, 0, 0, 0, "
    assert not first_stop(rules(typed, "\n"), "0, 0, 0, 0, 0]")[0]
    d, _ = first_stop(rules(typed, "\n"), "0, 0, 0, 0, 0, 0, 0, 0, 0, 0")
    assert d.reason == "repetition" and d.text.rstrip() == "0,"  # a copy past the cursor stays


def test_line_loops_only_cut_and_fire_at_their_thresholds():
    """Random lines: a text before a unit repeated k times (and a tail of it): the rule stops
    exactly when the unit (not itself made of repeats, nor of one or two characters) comes
    LINE_LOOPS' copies in a row, and what it keeps is a prefix of the text with no loop left."""
    import random

    from codecomplete.model.stops import LINE_LOOPS, line_loop

    rng = random.Random(7)
    alphabet = "abcxyz_(),. :=[]01"
    for _ in range(400):
        unit = "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 14)))
        k = rng.randint(1, 8)
        head = "".join(rng.choice("klmnopq") for _ in range(rng.randint(0, 6)))  # no letter of the units
        text = head + unit * k + unit[: rng.randint(0, len(unit) - 1)]
        d, _ = first_stop(rules("x = ", "\n"), text)
        plain = len(set(unit)) > 2 and all(unit != unit[:p] * (len(unit) // p)
                                           for p in range(1, len(unit)) if len(unit) % p == 0)
        need = [c for least, c in LINE_LOOPS if len(unit) >= least][-1]
        if plain:
            assert (d is not None) == (k >= need), (text, unit, k)
        if d is None:
            continue
        assert d.reason == "repetition" and text.startswith(d.text), (text, d.text)
        assert line_loop("x = " + d.text) is None
        if plain:
            assert len(d.text) <= len(head) + 2 * len(unit), (text, d.text)  # one copy, started on a word


def test_before_code_on_the_cursor_line_the_text_joins_that_code_as_written():
    # trailing spaces before code stay: ``return |x`` is not ``returnx``
    r = rules("def f(x):\n    ", "x\n")
    assert r.finish("return ") == "return "
    assert rules("y = ", "x\n").finish("not ", reason="line_end") == "not "
    # before a space or at a line's end they are stripped as everywhere
    assert rules("f(", " x)\n").finish("a, ") == "a,"
    assert rules("x = ", "\n").finish("1   ") == "1"
    # the model broke the line at the start of the line's code: a line of its own above it,
    # the code keeping its indentation
    top = rules("import os\n", "from types import TracebackType\n")
    d = top.check("from types import ModuleType\n")
    assert d.stop and d.reason == "line_end"
    assert top.finish(d.text, reason=d.reason) == "from types import ModuleType\n"
    indented = rules("def f(x):\n    ", "return x\n")
    assert indented.finish("x += 1", reason="line_end") == "x += 1\n    "
    # after code, a text that would glue a word onto the next one is no completion
    glued = rules("import os\nfrom types import ", "TracebackType\n")
    assert glued.finish("ModuleType", reason="line_end") == ""
    assert glued.finish("ModuleType", budget_cut=True) == ""
    assert glued.finish("ModuleType, ", reason="line_end") == "ModuleType, "
    # an end token ends the middle where the model chose: ``get_|value`` may be meant
    assert rules("x = ", "value\n").finish("get_") == "get_"
    # the model rewrote the rest of the line: unchanged (the item's range covers it)
    assert rules("print(", "x)\n").finish("y + x)  ", reason="suffix_overlap") == "y + x)"
    # only that code again adds nothing: no completion (``f(|)`` -> ``)``)
    assert rules("print(", "x)\n").finish("x)  ", reason="suffix_overlap") == ""
    assert rules("f(g(", "))\n").finish("))", reason="suffix_overlap") == ""
    # the line after the cursor written again at its start: the item would replace it with itself
    assert rules("def f(x):\n", "    return x\n").finish("    return x", reason="line_end") == ""
    # only whitespace is nothing
    assert rules("f(", "x)\n").finish("  ", reason="line_end") == ""


def test_line_breaks_are_lf_even_in_a_crlf_document():
    """Editors keep lines without their breaks: a ``\r`` before ``\n`` would be inserted as a
    character (Neovim's inline completion), so completions break lines with ``\n`` alone."""
    crlf = rules("import os\r\n\r\ndef files(folder):", "\r\n")
    assert crlf.finish("\r\n    out = []\r\n    return out") == "\n    out = []\n    return out"
    assert crlf.finish("\r\n    return []\n") == "\n    return []"
    single = rules("import os\r\nx = ", "\r\n")
    assert single.finish("1\r") == "1"
    # a line of its own above the code, in a CRLF file
    top = rules("import os\r\n", "from types import TracebackType\r\n")
    d = top.check("from types import ModuleType\r\n")
    assert d.reason == "line_end" and top.finish(d.text, reason=d.reason) == "from types import ModuleType\n"


def test_at_the_top_level_a_completion_is_one_paragraph():
    r = rules("import json\n\n# load the config file\n", "")
    text = "config = load_config()\n\n# load the data\ndata = load_data()\n"
    d = r.check(text)
    assert d.stop and d.reason == "block_end" and r.finish(d.text) == "config = load_config()"
    # a definition keeps its body, blank lines inside it included, and stops at the next one
    r = rules("import os\n\n", "")
    text = "def f(x):\n    y = x\n\n    return y\n\ndef g():\n"
    d = r.check(text)
    assert d.stop and r.finish(d.text) == "def f(x):\n    y = x\n\n    return y"
    # statements without a blank line between them stay one paragraph
    assert not rules("import os\n\n", "").check("import sys\nimport re\nx = 1\n").stop
    # a completion that starts with blank lines has no code before its first paragraph
    assert not rules("x = 1\n", "").check("\n\ny = 2\nz = 3\n").stop
    # inside a block the indentation bounds it as before: a paragraph at the cursor's level goes on
    assert not rules("def f():\n    ", "").check("x = 1\n\n    return x\n").stop
    # the rule can be turned off (bench/top_level.py's other arm)
    try:
        StopRules.top_level_paragraphs = False
        assert not rules("import os\n\n", "").check("x = 1\n\ny = 2\n").stop
    finally:
        StopRules.top_level_paragraphs = True


def test_an_indented_definition_is_one_paragraph():
    """On an indented blank line, a completion that starts a definition (a method, a nested
    function, a decorated one) stops before the next line back at the cursor's indentation
    after a blank line; blank lines inside its body do not end it."""
    cls = "class A:\n    def f(self):\n        return 1\n\n    "
    d = rules(cls, "\n").check("def g(self):\n        x = 1\n\n        return x\n\n    def h(self):\n")
    assert d.stop and d.reason == "block_end" and d.text == "def g(self):\n        x = 1\n\n        return x"
    d = rules(cls, "\n").check("@property\n    def g(self):\n        return 2\n\n    @property\n")
    assert d.stop and d.text == "@property\n    def g(self):\n        return 2"
    # a class attribute, a statement group in a function body: paragraphs go on as before
    assert not rules(cls, "\n").check("x = 1\n\n    y = 2\n").stop
    assert not rules("def f(x):\n    y = 1\n\n    ", "\n").check("for z in x:\n        y += z\n\n    return y\n").stop
    # the rule can be turned off (bench/top_level.py --indented's other arm)
    try:
        StopRules.definition_paragraphs = False
        assert not rules(cls, "\n").check("def g(self):\n        return 1\n\n    def h(self):\n").stop
    finally:
        StopRules.definition_paragraphs = True


def test_definitions_are_recognised_across_languages():
    """Definitions as editors' languages write them: keywords after modifiers, methods of brace
    languages by their headers, arrow functions' bodies, and what stands before a definition
    (decorators, annotations, attributes, doc comments); control statements and plain code are not."""
    definitions = [
        "def f(x):", "async def f():", "class A(B):", "@property", "@Override", "#[inline]", "/**", "/// Parses it.",
        "function load(url) {", "async function* walk(dir) {", "export default function App() {",
        "export const fetchAll = async (ids) => {", "it('retries on 503', () => {", "toJSON(asStrings) {",
        "static from(thing) {", "get size() {", "async request(configOrUrl, config) {",
        "public static void main(String[] args) {", "private int size()", "public function index()",
        "public async Task<IActionResult> Index()", "protected abstract Node parse(Reader in) throws IOException;",
        "pub fn new() -> Self {", "pub(crate) fn parse(&mut self) -> Result<()> {", "const fn mask() -> u8 {",
        "unsafe fn raw(p: *const u8) {", "impl<'a> Iterator for Chars<'a> {", "impl Display for Value {",
        "fn deserialize_bool<V>(self, visitor: V) -> Result<V::Value, Error>",
        "func (r *Reader) Read(p []byte) (int, error) {", "override fun onCreate(state: Bundle?) {",
        "private func reload() {", "int main(void) {", "Foo::Foo() : size(0) {", "interface Props {", "enum Kind {",
        "struct Point {", "trait Show {", "local function trim(s)", "defp parse(x) do", "template<T>(x: T): T {",
    ]
    statements = [
        "", "x = 1", "return x", "print(x)", "self.x = y", "data = {}", "module = load()", "object.attr = 1",
        "struct.pack('<I', n)", "type = 3", "# def f():", "// function x() {", "if (x) {", "} else {", "else if (a) {",
        "} catch (e) {", "catch (IOException e) {", "for (let i = 0; i < n; i++) {", "while (true) {", "switch (x) {",
        "try {", "return {", "x = {", "foo({", "return new Promise((resolve) => {", "match x {", "if let Some(v) = x {",
        "synchronized (lock) {", "const x = { a: 1 };", "let y = foo(bar);", "private final Gson gson = new Gson();",
        "await fetch(url)", "yield x",
    ]
    assert [d for d in definitions if not starts_definition(d)] == []
    assert [s for s in statements if starts_definition(s)] == []


def test_an_indented_definition_is_one_paragraph_in_brace_languages():
    """The definition rule in languages with braces: a JavaScript method, a Java method after its
    annotation, a Rust function after its doc comment, a test case's callback, a method or a Python
    function after a plain comment each stop before the next definition at the cursor's indentation;
    a statement block (``if``) or a commented statement group goes on as before."""
    cases = [  # (the text before the cursor, what the model wrote, what the completion keeps)
        ("class Client {\n  get(url) {\n    return this.request(url);\n  }\n\n  ",
         "post(url, data) {\n    const body = JSON.stringify(data);\n\n    return this.request(url, body);\n  }\n\n"
         "  put(url, data) {\n",
         "post(url, data) {\n    const body = JSON.stringify(data);\n\n    return this.request(url, body);\n  }"),
        ("class T {\n  @Test\n  public void a() {\n  }\n\n  ",
         "@Test\n  public void b() {\n    assertTrue(ok());\n  }\n\n  @Test\n",
         "@Test\n  public void b() {\n    assertTrue(ok());\n  }"),
        ("impl Value {\n    fn a(&self) {}\n\n    ",
         "/// The length.\n    pub fn len(&self) -> usize {\n        self.0.len()\n    }\n\n    /// Whether empty.\n",
         "/// The length.\n    pub fn len(&self) -> usize {\n        self.0.len()\n    }"),
        ("class Stack {\n  push(x) {\n    this.items.push(x);\n  }\n\n  ",  # a plain comment first
         "// The top item.\n  peek() {\n    return this.items.at(-1);\n  }\n\n  // The size.\n  size() {\n",
         "// The top item.\n  peek() {\n    return this.items.at(-1);\n  }"),
        ("class A:\n    def f(self):\n        return 1\n\n    ",
         "# The second.\n    def g(self):\n        return 2\n\n    def h(self):\n",
         "# The second.\n    def g(self):\n        return 2"),
        ("describe('get', () => {\n  it('works', () => {\n  });\n\n  ",
         "it('retries', async () => {\n    await get();\n  });\n\n  it('fails', () => {\n",
         "it('retries', async () => {\n    await get();\n  });"),
    ]
    for before, written, kept in cases:
        d = rules(before, "\n").check(written)
        assert d.stop and d.reason == "block_end" and d.text == kept, before
    # a comment before a statement group is no definition: the paragraphs go on
    assert not rules("def f(x):\n    y = 1\n\n    ", "\n").check("# add them up\n    y += x\n\n    return y\n").stop
    body = "function f(x) {\n  const y = x + 1;\n\n  "
    assert not rules(body, "\n").check("if (y > 1) {\n    log(y);\n  }\n\n  return y;\n").stop


def test_the_suffix_line_counts_only_at_its_own_indentation():
    """A line equal to the suffix's next line stops the completion where the suffix goes on, at
    that line's indentation; at another it is the completion's own (the closing brace of an
    ``if`` or a method before the class's, a nested ``return`` before the function's) and stays."""
    java = "class R {\n  Object read(JsonReader in) throws IOException {\n    "
    d = rules(java, "\n  }\n}\n").check("if (in.peek() == NULL) {\n      in.nextNull();\n      return null;\n    }\n"
                                       "    return in.next();\n  }\n")
    assert d.stop and d.reason == "suffix_overlap"
    assert d.text == "if (in.peek() == NULL) {\n      in.nextNull();\n      return null;\n    }\n    return in.next();"
    js = "class Client {\n  get(url) {\n    return this.request(url);\n  }\n\n  "
    d = rules(js, "\n}\n").check("post(url, data) {\n    return this.request(url, data);\n  }\n}\n")
    assert d.stop and d.text == "post(url, data) {\n    return this.request(url, data);\n  }"
    py = "def f(xs):\n    out = []\n    "
    d = rules(py, "\n    return out\n").check("for x in xs:\n        if x is None:\n            return out\n"
                                             "        out.append(x)\n    return out\n")
    assert d.stop and d.reason == "suffix_overlap"
    assert d.text == "for x in xs:\n        if x is None:\n            return out\n        out.append(x)"
    # the other arm of bench/infill.py --stop-rule suffix_at_indentation=0: at any indentation
    try:
        StopRules.suffix_at_indentation = False
        d = rules(java, "\n  }\n}\n").check("if (in.peek() == NULL) {\n      return null;\n    }\n")
        assert d.stop and d.text == "if (in.peek() == NULL) {\n      return null;"
    finally:
        StopRules.suffix_at_indentation = True


@pytest.mark.parametrize("text, rest, line_prefix, rewrites", [
    ("len(x))", ")", "    print(", True),  # the text closes print( too
    ("len(x)", ")", "    print(", False),  # ends with the ``)`` but leaves print( open: goes before it
    ("a), b)", "))", "f(g(", False),  # closes g( and f( but not where the code after the cursor does
    ("a, b);", ")", "foo(", True),  # the closer with a statement's end
    ("RuntimeError):", ")", "class Exit(", True),  # with a header's colon
    ("x > 0) {", ")", "  if (", True),  # with a block's opening
    ("x) => {", ")", "items.map((", True),
    ("x: string): void {", ")", "  handle(", True),  # a return type, then the block
    ("x: i32) -> i32 {", ")", "fn double(", True),
    ("e) throws IOException {", ")", "  void run(", True),
    ("self) -> list[int]:", ")", "    def sizes(", True),
    # return types with brackets of their own between the closer and the block or colon
    ("x: i32) -> Result<(), E> {", ")", "fn run(", True),
    ("x: i32) -> Option<(i32, i32)> {", ")", "fn pair(", True),
    ("self) -> Callable[[], None]:", ")", "    def hook(", True),
    ("a: number): (x: number) => void {", ")", "function make(", True),
    ("x) + g(y) {", ")", "f(", True),  # it closes f( itself: before the ``)`` it would leave one too many
    ("(x) => {", ")", "items.map(", False),  # its ``)`` closes its own ``(``
    ("x);", "x)", "f(", False),  # a statement's end only after closers alone
    ("\n    // don't\n    x;\n  }", "}", "  f() {", True),  # an apostrophe in a comment
    ('"(")', ")", "f(", True),  # a bracket inside a string
    ("y + x)", "x)", "print(", True),
    ("", ")", "f(", False),
    ("x", "", "f(", False),
])
def test_a_text_rewrites_the_code_after_the_cursor_where_it_closes_what_that_code_closes(
        text, rest, line_prefix, rewrites):
    """Guards ``rewrites_rest``: the item replaces the code after the cursor (an editor's
    closers) only where the text closes what that code closes; without the line before the
    cursor, ending with it is enough (as before)."""
    assert stops.rewrites_rest(text, rest, line_prefix) == rewrites
    if text.rstrip().endswith(rest.strip()) and rest.strip():
        assert stops.rewrites_rest(text, rest)


def test_a_nested_call_does_not_stop_at_its_own_closer():
    """``print(|)``: the model writes ``len(x)`` then ``)`` as two tokens; the text ``len(x)``
    ends with the ``)`` after the cursor but leaves ``print(`` open, so decoding goes on (it
    stopped there, and the item covered print's ``)``: ``print(len(x)``), and stops once it
    closes print's too."""
    r = rules("    print(", ")\n")
    assert [r.check(t).stop for t in ("len(", "len(x", "len(x)", "len(x))")] == [False, False, False, True]
    assert r.check("len(x))").reason == "suffix_overlap"
    # a closer with a comma does not stop decoding: the argument list may go on
    r = rules("    a, b = int(", ")\n")
    assert not r.check("a),").stop and r.check("a), int(b)").stop
    assert r.finish("a),", reason="line_end") == "a),"  # though where it ended, it rewrote the ``)``
