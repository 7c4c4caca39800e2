"""Fill-in-the-middle prompt templates, detected from a tokenizer's special tokens.

A template says which special tokens frame the prefix, the suffix and the middle, and
which tokens end a completion.  Each template builds its prompt from *segments* that
are tokenized separately, so the ids of an earlier segment never depend on a later one
(the property EFIM's session pool relies on).  No tokenizer import here: the template
is plain data, the engine turns segments into ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FimTemplate:
    """One FIM family: the special tokens and their order (PSM)."""

    name: str
    prefix: str
    suffix: str
    middle: str
    stop: tuple[str, ...] = ()
    # CodeLlama puts a space after <PRE> and before <MID>; most families put none.
    prefix_pad: str = ""
    middle_pad: str = ""

    def psm_segments(self, prefix: str, suffix: str) -> list[tuple[str, bool]]:
        """``<P>prefix<S>suffix<M>``: a list of (text, is_special) segments."""
        return [
            (self.prefix, True),
            (self.prefix_pad + prefix, False),
            (self.suffix, True),
            (suffix, False),
            (self.middle, True),
            *([(self.middle_pad, False)] if self.middle_pad else []),
        ]

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return (self.prefix, self.suffix, self.middle, *self.stop)


# Order matters: the first template whose three tokens are all in the vocabulary wins.
TEMPLATES: dict[str, FimTemplate] = {
    t.name: t
    for t in (
        # The project's own default model (SmolLM2 taught FIM) uses the StarCoder names.
        FimTemplate("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>",
                    stop=("<|endoftext|>", "<file_sep>", "<fim_pad>")),
        FimTemplate("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                    stop=("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|im_end|>")),
        FimTemplate("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>",
                    stop=("<｜end▁of▁sentence｜>", "<|EOT|>")),
        FimTemplate("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", stop=("▁<EOT>",),
                    prefix_pad=" ", middle_pad=""),
        FimTemplate("codellama-plain", "<PRE>", "<SUF>", "<MID>", stop=("<EOT>",),
                    prefix_pad=" ", middle_pad=""),
    )
}

PREFIX_ONLY = "prefix-only"


@dataclass(frozen=True)
class TemplateChoice:
    """The outcome of detection: a template, or ``None`` for prefix-only prompts."""

    template: FimTemplate | None
    reason: str = field(default="")

    @property
    def name(self) -> str:
        return self.template.name if self.template else PREFIX_ONLY


def detect_template(vocab: set[str] | dict[str, int], override: str = "auto") -> TemplateChoice:
    """Pick the FIM template whose tokens the vocabulary has.

    ``override`` is a template name, ``prefix-only`` or ``auto``.  An override naming
    tokens the vocabulary lacks is refused (the prompt would be garbage), with the
    reason, and detection runs instead.
    """
    if override == PREFIX_ONLY:
        return TemplateChoice(None, "configured")
    if override != "auto":
        t = TEMPLATES.get(override)
        if t is None:
            reason = f"unknown template {override!r}; detecting"
        elif all(tok in vocab for tok in (t.prefix, t.suffix, t.middle)):
            return TemplateChoice(t, "configured")
        else:
            reason = f"template {override!r} needs tokens the tokenizer lacks; detecting"
        found = detect_template(vocab)
        return TemplateChoice(found.template, reason)
    for t in TEMPLATES.values():
        if all(tok in vocab for tok in (t.prefix, t.suffix, t.middle)):
            return TemplateChoice(t, "detected")
    return TemplateChoice(None, "no FIM tokens in the vocabulary")
