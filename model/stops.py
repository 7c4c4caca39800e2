"""Stop rules and completion shaping: plain text logic, no torch.

``CompletionShape`` is derived once per request from the text around the cursor
(single- or multi-line, the indentation that bounds the block, the suffix's first
line).  ``StopRules.check(text)`` is called after every decoded token with the text
generated so far and says whether to stop and where to cut.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# what an editor that closes pairs (VS Code's autoClosingBrackets / autoClosingQuotes, Neovim's
# autopairs plugins) puts after the cursor when the user types the opener (``open_pairs``)
PAIRS = {"(": ")", "[": "]", "{": "}", '"': '"', "'": "'", "`": "`"}
_QUOTES = frozenset("\"'`")
_OPENERS = (":", "{", "(", "[", "=>", "->", "do", "then")
_CLOSERS_ONLY = re.compile(r"^[\s\)\]\}\"'`;,]*$")
# What starts a definition (``starts_definition``), in the languages editors send.  Modifiers that may
# stand before a definition's keyword (``export default function``, ``pub(crate) fn``, ``override fun``):
_MODIFIERS = (r"(?:(?:export|default|public|private|protected|internal|static|final|abstract|override|virtual"
              r"|async|unsafe|extern|inline|open|suspend|sealed|data|inner|readonly|declare|partial"
              r"|synchronized|native|fileprivate|mutating|local|pub(?:\([\w\s:]*\))?|const(?=\s+fn\b))\s+)*")
# a definition's keyword followed by a name, parameters or generics (``fn = f`` is no definition); ``object`` and
# ``module`` (Kotlin, Scala, Ruby) before a capitalised name only (``object to send`` in a docstring is prose)
_KEYWORD_DEFINITION = re.compile(
    _MODIFIERS + r"(?:(?:def|defp|defmodule|class|function\*?|fn|func|fun|interface|struct|enum|trait|impl)"
    r"\s+[\w$({<*&]|(?:object|module)\s+[A-Z]|impl<|function\s*\()")
# a method with an access modifier, its brace perhaps on the next line (Java, C#, PHP: ``public void f()``)
_ACCESS_METHOD = re.compile(r"(?:public|private|protected|internal|static|override|virtual|abstract)\s+[^=]*\(")
# a header that opens a body after its parameters (``get name() {``, ``int main(void) {``, ``f(a): T {``)
_HEADER = re.compile(r"[A-Za-z_$][\w$.:<>,\s\[\]*&?]*\(.*\)[^(){};=]*\{$")
# an arrow function's body (``const f = (x) => {``, ``it("works", () => {``)
_ARROW = re.compile(r"[A-Za-z_$\[(].*=>\s*\{$")
# a decorator or annotation (``@property``, ``@Override``), an attribute (``#[inline]``), a doc comment
_PREAMBLE = re.compile(r"@[A-Za-z_]|#\[\w|/\*\*|///")
# statements whose header looks like a call with a body (``if (x) {``), never a definition
_CONTROL = frozenset("if for while switch catch return else do try with using lock foreach synchronized elif unless "
                     "until when match guard defer fixed checked unchecked await yield throw new case loop select "
                     "go echo print".split())
_FIRST_WORD = re.compile(r"[A-Za-z_$][\w$]*")
# a comment line that is no doc comment or attribute (``// note``, ``# note``; not ``///``, ``#[``)
_PLAIN_COMMENT = re.compile(r"//(?!/)|#(?!\[)")


def starts_definition(line: str) -> bool:
    """Whether ``line`` starts a definition: a function, method, class or the like (Python's
    ``def``/``class``; ``function``, ``fn``, ``func``, ``fun``, ``struct``, ``impl``... after
    modifiers; a method's header: ``name(params) {``, ``public void f()``; an arrow function's
    body), or what stands before one: a decorator or annotation, a Rust attribute, a doc comment
    (``/**``, ``///``).  A control statement (``if (x) {``, ``catch (e) {``) is none."""
    s = line.strip()
    if not s:
        return False
    if _PREAMBLE.match(s) or _KEYWORD_DEFINITION.match(s):
        return True
    first = _FIRST_WORD.match(s)
    if first and first.group() in _CONTROL:
        return False
    return bool(_ACCESS_METHOD.match(s) or _HEADER.match(s) or _ARROW.match(s))


def first_code_line(lines: list[str]) -> str:
    """The first of ``lines`` that is neither blank nor a plain comment ("" if none): what a
    completion that opens with a comment (``# Parse the header.`` / ``def parse(...)``) starts."""
    return next((line for line in lines if line.strip() and not _PLAIN_COMMENT.match(line.strip())), "")


def leading_ws(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def indent_width(ws: str, tab: int = 4) -> int:
    return sum(tab if c == "\t" else 1 for c in ws)


@dataclass(frozen=True)
class CompletionShape:
    """What kind of completion fits at the cursor."""

    multiline: bool
    line_prefix: str  # text of the cursor line before the cursor
    line_suffix: str  # text of the cursor line after the cursor
    base_indent: int  # indentation width of the cursor line
    opens_block: bool  # the cursor line ends with a block opener
    suffix_head: str  # first non-blank line of the suffix after the cursor line, stripped
    suffix_head_indent: int = 0  # and its indentation width

    @classmethod
    def at_cursor(cls, prefix: str, suffix: str, mode: str = "auto") -> "CompletionShape":
        line_prefix = prefix.rsplit("\n", 1)[-1]
        line_suffix, _, rest = suffix.partition("\n")
        head = next((ln for ln in rest.split("\n") if ln.strip()), "")
        opens = line_prefix.rstrip().endswith(_OPENERS)
        if mode == "single":
            multi = False
        elif mode == "multi":
            multi = True
        else:
            # Mid-line (real code after the cursor), or inside brackets the editor
            # closed (``foo(|)``): finish this line.  On a blank line, at the end of a
            # line that opens a block, or between braces (``{|}``): offer a block.
            rest = line_suffix.strip()
            if not rest:
                multi = opens or not line_prefix.strip()
            else:
                multi = bool(_CLOSERS_ONLY.match(rest)) and line_prefix.rstrip().endswith("{")
        return cls(multi, line_prefix, line_suffix,
                   indent_width(leading_ws(line_prefix)), opens, head.strip(), indent_width(leading_ws(head)))


@dataclass
class StopDecision:
    stop: bool
    text: str
    reason: str = ""


class StopRules:
    """Decide, after each token, whether the completion is complete."""

    # On a blank line at column 0 (the top level), stop before a line at column 0 that follows
    # a blank line once the completion has code: one paragraph (bench/top_level.py).
    top_level_paragraphs = True
    # On an indented blank line, a completion that starts a definition (a method in a class body)
    # stops before a line back at the cursor's indentation after a blank line: that definition
    # (bench/top_level.py --indented).
    definition_paragraphs = True
    # A completion's line equal to the suffix's next line ends it only at that line's indentation
    # (off: at any indentation, which cut an ``if``'s ``}`` before a class's ``}``; bench/infill.py
    # --stop-rule suffix_at_indentation=0 is the other arm).
    suffix_at_indentation = True

    def __init__(self, shape: CompletionShape, max_lines: int):
        self.shape = shape
        self.max_lines = max(1, max_lines)
        self._lines_checked = 0  # complete lines the loop check last saw (it runs once per new line)

    def check(self, text: str) -> StopDecision:
        shape = self.shape
        if not shape.multiline:
            # At the end of a line the single line offered may be the next one
            # (newline, indentation, code); mid-line it is the rest of this one.
            start = 0
            if not shape.line_suffix.strip():
                start = len(text) - len(text.lstrip())
                if start == len(text):
                    return StopDecision(False, text)
            cut = text.find("\n", start)
            if cut >= 0:
                return StopDecision(True, text[:cut], "line_end")
            return self._line_loop(text) or self._suffix_on_line(text)
        lines = text.split("\n")
        complete = lines[:-1]  # the last line may still be growing
        blank_run = 0
        fresh = not shape.opens_block and not shape.line_prefix.strip()  # a blank line, its indentation typed
        # one paragraph: at the top level, or a definition started on an indented fresh line (perhaps
        # after a comment)
        paragraph = fresh and (self.top_level_paragraphs and shape.base_indent == 0 or self.definition_paragraphs
                               and shape.base_indent > 0 and starts_definition(first_code_line(lines)))
        code = bool(lines[0].strip())  # the completion has a line of code before this one
        for i, line in enumerate(complete):
            if i == 0:
                continue  # the rest of the cursor line
            if not line.strip():
                blank_run += 1
                if blank_run >= 2:
                    return StopDecision(True, "\n".join(lines[: i - 1]), "blank_lines")
                continue
            width = indent_width(leading_ws(line))
            if paragraph and code and blank_run and width <= shape.base_indent:
                return StopDecision(True, "\n".join(lines[:i - blank_run]), "block_end")
            blank_run = 0
            code = True
            # The model wrote the suffix's next line, at its place: the suffix goes on from there.  At
            # another indentation it is the completion's own line (an ``if``'s ``}`` before the
            # class's ``}``, a nested ``return x`` before the function's), which stays.
            if line.strip() == shape.suffix_head and (width == shape.suffix_head_indent
                                                       or not self.suffix_at_indentation):
                return StopDecision(True, "\n".join(lines[:i]), "suffix_overlap")
            limit = shape.base_indent if shape.opens_block else shape.base_indent - 1
            # A line at or left of the bound ends the block; a lone closer at the
            # opener's level (``}``) belongs to it, and ends it just after.
            if width <= limit:
                if shape.opens_block and width == shape.base_indent and _CLOSERS_ONLY.match(line):
                    return StopDecision(True, "\n".join(lines[: i + 1]), "block_end")
                return StopDecision(True, "\n".join(lines[:i]), "block_end")
            if i >= self.max_lines:
                return StopDecision(True, "\n".join(lines[:i]), "max_lines")
        if len(complete) != self._lines_checked:
            self._lines_checked = len(complete)
            keep = repetition_cut(complete, shape.line_prefix)
            if keep is not None:
                return StopDecision(True, "\n".join(lines[:keep]), "repetition")
        return self._line_loop(text) or StopDecision(False, text)

    def _line_loop(self, text: str) -> StopDecision | None:
        """The last line ends in a loop inside the line (``line_loop``): keep what comes before
        the repetition and its copies up to the first that reaches past the cursor; or, after
        whole lines with code, drop the line (as a line the budget cut)."""
        nl = text.rfind("\n")
        typed = self.shape.line_prefix if nl < 0 else ""
        line = typed + text[nl + 1:]
        if len(line) - len(typed) < LINE_LOOPS[0][0]:
            return None
        found = line_loop(line, len(typed))
        if found is None:
            return None
        start, unit = found
        keep = start + unit
        while keep <= len(typed):
            keep += unit
        head = text[:max(nl, 0)]
        if head.strip():
            return StopDecision(True, head, "repetition")
        return StopDecision(True, text[:nl + 1] + line[len(typed):keep], "repetition")

    def _suffix_on_line(self, text: str) -> StopDecision:
        # The model rewrote what already follows the cursor: stop after it.
        if rewrites_rest(text, self.shape.line_suffix, self.shape.line_prefix, after_closers=False) \
                and len(text.strip()) > len(self.shape.line_suffix.strip()):
            return StopDecision(True, text, "suffix_overlap")
        return StopDecision(False, text)

    def finish(self, text: str, budget_cut: bool = False, reason: str = "") -> str:
        """Shape the final text: in multi-line mode drop trailing blank lines, and when the
        token or time budget cut the text (``budget_cut``) the partial line it cut too, if
        a complete line with code stands before it (a half-written statement, perhaps past the
        block's end, is no suggestion; the next request continues from the whole lines);
        trailing whitespace everywhere except before code on the cursor's line
        (``_mid_line``); nothing for a text that is only the code after the cursor on its line
        again (``f(|)`` -> ``)``: accepting it changes nothing); line breaks ``\n`` even in a
        CRLF file, where the model writes ``\r\n`` after CRLF lines: editors hold lines without
        their breaks and turn an inserted ``\n`` into the file's own (VS Code) or insert a ``\r``
        as a character (Neovim's inline completion splits at ``\n`` only; Emacs, Vim).  ``reason``: why decoding stopped
        (``line_end``: at a line break).  A character cut between its byte-level tokens (the
        budget ended inside a CJK word or an emoji; the decode ends in U+FFFD) is dropped."""
        text = self._shaped(text.rstrip("\ufffd"), budget_cut, reason).replace("\r\n", "\n")
        if CLOSER_RULES and text.strip() and text.strip() == self.shape.line_suffix.strip():
            return ""  # only the code after the cursor again (``f(|)`` -> ``)``): nothing to offer
        return text

    def _shaped(self, text: str, budget_cut: bool, reason: str) -> str:
        if not self.shape.multiline and self.shape.line_suffix.strip():
            return self._mid_line(text, reason == "line_end", budget_cut)
        if self.shape.multiline:
            lines = text.split("\n")
            if budget_cut and len(lines) > 1 and "".join(lines[:-1]).strip():
                lines.pop()
            while len(lines) > 1 and not lines[-1].strip():
                lines.pop()
            text = "\n".join(lines)
        return text.rstrip()

    def _mid_line(self, text: str, broke_line: bool, budget_cut: bool) -> str:
        """The text to insert before code that stays on the cursor's line (``line_suffix``).

        Its trailing spaces stay where that code starts at once (``return |x`` takes
        ``return ``; stripped, it read ``returnx``).  Where the model broke the line
        (``broke_line``: the single-line rule cut its text at a line break), the break was part
        of what it wrote: at the start of the line's code (only indentation before the cursor)
        the text becomes a line of its own above that code, which keeps its indentation;
        after code on the line, or where a budget cut the text, a text that would join a word
        to the word after the cursor (``ModuleType|from`` -> ``ModuleTypefrom``) is no
        completion, and none is offered.  A text that ends with that code (the model rewrote
        it) stays as it is: the item's range then covers the code (lsp.server)."""
        tail = self.shape.line_suffix
        body = text.rstrip() if tail[0].isspace() else text.rstrip("\r\n")
        if not body.strip():
            return ""
        if rewrites_rest(body, tail, self.shape.line_prefix):
            return body.rstrip()
        if broke_line and not self.shape.line_prefix.strip():
            return body.rstrip() + "\n" + self.shape.line_prefix
        if (broke_line or budget_cut) and word_char(body[-1]) and word_char(tail[0]):
            return ""
        return body


EXACT_COPIES = {1: 3, 2: 2, 3: 2, 4: 2}  # a block of n lines repeated this many times in a row is a loop
NEAR_RUN = 6  # this many consecutive lines, each nearly the one before (<= 10 % edits), is a loop
# a block of 2-4 lines, each line nearly (or exactly) the line a block before, this many times in a
# row is a loop (``if s.startswith("00"):`` / ``raise Abort()`` / ... ``"000"`` ...); 0: off
NEAR_BLOCK_COPIES = 3


def repetition_cut(complete: list[str], line_prefix: str = "") -> int | None:
    """How many of ``complete`` (the completion's whole lines; the first is the rest of the
    cursor's line, after ``line_prefix``) to keep when they end in a loop, the way small models degenerate: a block
    of 1-4 lines repeated back to back (3 copies of one line, 2 of a longer block; blank
    lines between copies are ignored) keeps its first copy; so does a block of 2-4 lines
    repeated NEAR_BLOCK_COPIES times with each line within 10 % edits of its line in the block
    before (``if name.startswith("tree"):`` / ``continue`` / ``if name.startswith("tree_"):`` ...;
    bench/results/repetition_near_block_avx2.md); a run of NEAR_RUN lines each within 10 % edits
    of the one before (``# v1.4``, ``# v1.5``...) keeps its first line.
    None when they do not end in a loop."""
    lines = [line_prefix + complete[0], *complete[1:]] if complete else []
    idx = [i for i, line in enumerate(lines) if line.strip()]
    rows = [lines[i].rstrip() for i in idx]
    for n, copies in EXACT_COPIES.items():
        span = n * copies
        if len(rows) < span:
            continue
        tail = rows[-span:]
        if all(tail[j] == tail[j % n] for j in range(n, span)):
            return idx[len(rows) - span + n - 1] + 1
    run = 1
    while run < len(rows) and _near(rows[-run], rows[-run - 1]):
        run += 1
    if run >= NEAR_RUN:
        return idx[len(rows) - run] + 1
    for n in range(2, 5) if NEAR_BLOCK_COPIES else ():  # after the run: its lines make near blocks too
        span = n * NEAR_BLOCK_COPIES
        if len(rows) < span:
            break
        tail = rows[-span:]
        if all(tail[j] == tail[j - n] or _near(tail[j], tail[j - n]) for j in range(n, span)):
            return idx[len(rows) - span + n - 1] + 1
    return None


LINE_LOOPS = ((3, 6), (10, 3))  # (shortest unit, copies): a unit of 3-9 characters 6 times, of 10+ 3 times
LINE_LOOP_UNIT = 80  # the longest unit looked for


def line_loop(line: str, typed: int = 0,
              copies: tuple[tuple[int, int], ...] = LINE_LOOPS) -> tuple[int, int] | None:
    """Whether ``line`` ends in a loop inside the line, the way small models run away
    (``os.path.getsize(os.path.getsize(os.path.getsize(``, ``Any, Any, Any, Any, Any, Any``): a
    unit repeated back to back at its end, ``copies`` times for the unit's length, all of them
    after the first ``typed`` characters (the user's own text: continuing a row of ``0, `` the
    user typed is no loop until the model has written that many copies itself).  Tabby's
    ``removeLineEndsWithRepetition`` asks 6 and 4 copies; 3 for a long unit stops a copy sooner
    and cuts 0.008 % of the standard library's lines (bench/results/repetition_line_avx512.md).
    A run of one or two characters repeating (``------``, ``-=-=-=``, ``0000``) is never a loop.
    Returns (where the repetition starts, the unit's length), the shortest unit first; a start
    inside a word moves to the first copy that begins with one (``compute(alpha_value(alpha_value(``:
    at ``alpha``, not at ``compute``'s ``e``); None when the line does not end in a loop."""
    n = len(line)
    last = line[-1:]
    unit = copies[0][0] - 1
    while True:  # the units whose copy would end with the line's last character
        unit = line.rfind(last, 0, n - 1 - unit) if unit < n - 1 else -1
        unit = n - 1 - unit if unit >= 0 else 0
        if not unit or unit > LINE_LOOP_UNIT:
            return None
        need = 0
        for least, c in copies:
            if unit >= least:
                need = c
        if unit * need > n - typed:
            continue
        span = unit * need
        tail = line[n - span:]
        if tail[unit:] != tail[:-unit] or tail[2:] == tail[:-2]:
            continue
        start = n - span  # walk back while the period holds
        while start > 0 and line[start - 1] == line[start - 1 + unit]:
            start -= 1
        if start and word_char(line[start - 1]) and word_char(line[start]):  # the run starts inside a word:
            for p in range(start + 1, start + unit):  # the first copy that starts at one, if any
                if word_char(line[p]) and not word_char(line[p - 1]):
                    return p, unit
        return start, unit


# rewrites_rest asks the text to close what the code after the cursor closes, takes closers with a statement's
# end, and a text that is only that code is no completion; False: the rule before (bench A/B)
CLOSER_RULES = True
_BRACKET_CLOSERS = re.compile(r"[\)\]\}]+")
# what a statement's or a header's closers come with: its end, a block's opening after a return type,
# ``throws`` or ``where`` (``): void {``, ``) -> i32 {``), an arrow, Python's ``-> int:``
_AFTER_CLOSERS = re.compile(r"\s*(?:[;,:]|=>\s*\{?|[^\n(){};]*\{|->[^\n(){};]*:)")


def rewrites_rest(text: str, rest: str, line_prefix: str | None = None, after_closers: bool = True) -> bool:
    """Whether ``text`` ends with ``rest``, the code after the cursor on its line (both stripped):
    the model wrote that code again, so the text replaces it rather than going before it.  Where
    that code is closing brackets (an editor's, ``foo(|)``), a text that ends with them and a
    statement's end or a block's opening (``x);``, ``RuntimeError):``, ``x > 0) {``,
    ``x: string): void {``, ``self) -> int:``) rewrote them too.  With ``line_prefix`` (the line
    before the cursor), only a text that closes there what that code closes: after ``print(`` the
    text ``len(x)`` ends with the ``)`` after the cursor but leaves ``print(`` open, and goes before
    it (brackets counted with strings skipped, or, for an apostrophe in a comment, without).
    ``after_closers=False``: the text ends with that code itself (decoding stops there: at
    ``int(a),`` an argument list may go on)."""
    tail = rest.strip()
    body = text.rstrip()
    if not tail:
        return False
    if not CLOSER_RULES:
        return body.endswith(tail)
    if body.endswith(tail):
        head = body
    elif after_closers and _BRACKET_CLOSERS.fullmatch(tail):
        at = body.rfind(tail)
        if at < 0 or not _AFTER_CLOSERS.fullmatch(body, at + len(tail)):
            return False
        head = body[:at + len(tail)]
    else:
        return False
    if line_prefix is None:
        return True
    return any(open_pairs(line_prefix + head, quotes) == open_pairs(line_prefix + tail, quotes)
               for quotes in (True, False))


def agrees(so_far: str, typed: str) -> bool:
    """Whether a completion's text so far and the text typed at its cursor since agree: one
    starts the other (the daemon keeps a run going while the user types along it).  A character
    the text so far holds only part of (its decode ends in U+FFFD: the rest of its bytes come with
    the next token) agrees with any."""
    so_far = so_far.rstrip("\ufffd")
    return so_far.startswith(typed) or typed.startswith(so_far)


def open_pairs(typed: str, quotes: bool = True) -> str:
    """The closers of the brackets and quotes ``typed`` leaves open, innermost first
    (``foo(bar("`` -> ``")``): what an editor that closes pairs put after the cursor while it
    was typed.  Inside quotes only the quote (not after a backslash) closes; a closer of what
    was opened before ``typed`` is passed over.  ``quotes=False``: brackets alone, quote
    characters ignored."""
    stack: list[str] = []
    escaped = False
    for ch in typed:
        if not quotes and ch in _QUOTES:
            continue
        if stack and stack[-1] in _QUOTES:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == stack[-1]:
                stack.pop()
            continue
        if ch in PAIRS:
            stack.append(ch)
        elif stack and ch == PAIRS[stack[-1]]:
            stack.pop()
    return "".join(PAIRS[c] for c in reversed(stack))


def word_char(ch: str) -> bool:
    """A character of an identifier (any script's letters and digits, and ``_``)."""
    return ch.isalnum() or ch == "_"


def _near(a: str, b: str) -> bool:
    """Same indentation and at most 10 % of the longer line's characters edited."""
    if leading_ws(a) != leading_ws(b):
        return False
    a, b = a.strip(), b.strip()
    bound = int(0.1 * max(len(a), len(b)))
    if abs(len(a) - len(b)) > bound:
        return False
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
        if min(cur) > bound:
            return False
        prev = cur
    return prev[-1] <= bound
