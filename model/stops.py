"""Stop rules and completion shaping: plain text logic, no torch.

``CompletionShape`` is derived once per request from the text around the cursor
(single- or multi-line, the indentation that bounds the block, the suffix's first
line).  ``StopRules.check(text)`` is called after every decoded token with the text
generated so far and says whether to stop and where to cut.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OPENERS = (":", "{", "(", "[", "=>", "->", "do", "then")
_CLOSERS_ONLY = re.compile(r"^[\s\)\]\}\"'`;,]*$")


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

    @classmethod
    def at_cursor(cls, prefix: str, suffix: str, mode: str = "auto") -> "CompletionShape":
        line_prefix = prefix.rsplit("\n", 1)[-1]
        line_suffix, _, rest = suffix.partition("\n")
        head = next((ln.strip() for ln in rest.split("\n") if ln.strip()), "")
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
                   indent_width(leading_ws(line_prefix)), opens, head)


@dataclass
class StopDecision:
    stop: bool
    text: str
    reason: str = ""


class StopRules:
    """Decide, after each token, whether the completion is complete."""

    def __init__(self, shape: CompletionShape, max_lines: int):
        self.shape = shape
        self.max_lines = max(1, max_lines)

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
            return self._suffix_on_line(text)
        lines = text.split("\n")
        complete = lines[:-1]  # the last line may still be growing
        blank_run = 0
        for i, line in enumerate(complete):
            if i == 0:
                continue  # the rest of the cursor line
            if not line.strip():
                blank_run += 1
                if blank_run >= 2:
                    return StopDecision(True, "\n".join(lines[: i - 1]), "blank_lines")
                continue
            blank_run = 0
            width = indent_width(leading_ws(line))
            if line.strip() == shape.suffix_head:
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
        return StopDecision(False, text)

    def _suffix_on_line(self, text: str) -> StopDecision:
        # The model rewrote what already follows the cursor: stop after it.
        tail = self.shape.line_suffix.strip()
        if tail and text.rstrip().endswith(tail) and len(text.strip()) > len(tail):
            return StopDecision(True, text, "suffix_overlap")
        return StopDecision(False, text)

    def finish(self, text: str) -> str:
        """Shape the final text: drop a trailing partial line in multi-line mode only
        when it is blank, and trailing whitespace everywhere."""
        if self.shape.multiline:
            lines = text.split("\n")
            while len(lines) > 1 and not lines[-1].strip():
                lines.pop()
            text = "\n".join(lines)
        return text.rstrip()
