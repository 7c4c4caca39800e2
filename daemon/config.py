"""Typed configuration: defaults, config files, editor settings, command-line flags.

One ``Config`` object is built in ``daemon/`` and handed out as a value.  Sources, from
weakest to strongest: defaults, the user config file
(``<user config dir>/codecomplete/config.toml``), the repository's
``.codecomplete.toml``, the editor's ``initializationOptions`` /
``workspace/didChangeConfiguration`` (key ``codecomplete`` or top level), and the
command-line flags.  ``merge`` never raises: an invalid value keeps the previous value
and adds a warning; an unknown key adds a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

log = logging.getLogger(__name__)

REPO_CONFIG = ".codecomplete.toml"


def _choice(*options: str) -> dict:
    return {"choices": options}


def _range(lo: float | None = None, hi: float | None = None) -> dict:
    return {"min": lo, "max": hi}


@dataclass
class ModelConfig:
    name: str = "default"  # "default", a checkpoint directory, a .gguf file, or a cached hub id
    device: str = field(default="auto", metadata=_choice("auto", "cpu", "cuda"))
    dtype: str = field(default="auto", metadata=_choice("auto", "float32", "bfloat16", "float16"))
    template: str = field(default="auto", metadata=_choice(
        "auto", "prefix-only", "starcoder", "qwen", "deepseek", "codellama", "codellama-plain"))
    threads: int = field(default=0, metadata=_range(0, 256))  # 0: torch's default
    # fewer threads while other processes use the cores (two daemons, a build): OpenMP's spinning
    # barriers collapse when oversubscribed (docs/decisions.md)
    adaptive_threads: bool = True
    pack_weights: bool = True  # oneDNN-prepacked linear weights on CPU: faster decoding, same results
    native_attention: bool = True  # decode attention in a C kernel built on first use (needs a C compiler)
    # the layers' matrices: bf16 as the checkpoint has them, or int8 with a scale per output row (half the
    # bytes a decode step reads: faster decoding, outputs close to but not always the bf16 model's; CPU, bf16)
    weights: str = field(default="bf16", metadata=_choice("bf16", "int8"))


@dataclass
class CompletionConfig:
    enabled: bool = True
    mode: str = field(default="auto", metadata=_choice("auto", "single", "multi"))
    max_tokens: int = field(default=64, metadata=_range(1, 1024))
    max_lines: int = field(default=12, metadata=_range(1, 200))
    time_budget_ms: int = field(default=3000, metadata=_range(50, 60000))
    # an automatic request runs once its document has been this quiet (since its last change or
    # automatic request); the time the editor took to ask counts
    debounce_ms: int = field(default=25, metadata=_range(0, 2000))
    max_prefix_tokens: int = field(default=1024, metadata=_range(16, 32768))
    max_suffix_tokens: int = field(default=256, metadata=_range(0, 32768))
    token_healing: bool = True
    # Repository snippets at the head of the prompt (definitions of names used near the
    # cursor, similar code); 0 = none.  Off by default: with the default model the replay
    # harness measured no steady gain for their prefill (bench/results/context_snippets.md).
    context_snippets: int = field(default=0, metadata=_range(0, 16))
    context_tokens: int = field(default=256, metadata=_range(16, 8192))
    max_document_bytes: int = field(default=2_000_000, metadata=_range(1024, None))
    # textDocument/completion (a completion-menu item) for clients without inline
    # completions (Neovim <= 0.11 with nvim-cmp, Helix, Emacs, Sublime): "auto" serves it
    # only to clients that did not announce inline-completion support, so an editor that
    # asks both (VS Code) does not run the model twice per keystroke.
    lsp_completion: str = field(default="auto", metadata=_choice("auto", "always", "never"))
    # While the user types the start of the last completion, answer with its rest at once
    # instead of running the model again (the suggestion stays as typed through).
    type_through: bool = True
    # While the user types what a completion still being made starts with, keep making it (instead
    # of starting over at each keystroke) and answer the next request at the cursor with its rest.
    type_along: bool = True
    # Answer a request whose document, cursor text, snippets and settings are exactly an
    # earlier request's with that request's completion, without the model (the user typed a
    # character and deleted it, moved away and back, asked again).  Entries kept; 0: off.
    cache_entries: int = field(default=256, metadata=_range(0, 65536))
    # No completions in these languages (the LSP language ids editors send: "plaintext",
    # "markdown", "yaml"...) or files (gitignore-style patterns, relative to the workspace
    # folder: ".env", "secrets/**", "*.min.js").  A list, or one comma-separated string.
    disabled_languages: tuple[str, ...] = ()
    disabled_paths: tuple[str, ...] = ()
    # Completions offered when the user asks for one (an invoked request: VS Code's
    # Alt+\ or cycling with Alt+] / Alt+[, the Neovim plugin's next / previous keys, a
    # menu's Ctrl+Space): the greedy one and up to this many - 1 others, decoded together
    # with it, each branching where the model is unsure.  Requests made while typing get
    # the greedy one alone.  1: never more than one.
    alternatives: int = field(default=3, metadata=_range(1, 8))
    # After an edit on another line than the last request's (the user moved: opened a file,
    # jumped to a hunk, started a line), prefill the prompt at the edit this many ms later,
    # when no request is in flight, so that the request made at the user's next pause finds
    # the prompt's KV cached instead of prefilling it cold.  A request stops a warm-up at its
    # next piece of 256 tokens (what ran is kept).  0: off.
    warm_ms: int = field(default=50, metadata=_range(0, 60000))
    # Start the completion at the cursor ``start_ms`` after a keystroke that no other edit or
    # request follows, before the editor asks, and let the request take the run over (as it does
    # a run typed along: ``type_along`` must be on).  For editors that wait after the typing stops
    # before they ask (Neovim 0.12's built-in client: 200 ms): the run gets that time as a head
    # start.  "auto": once the editor's automatic requests are seen to come that late (the median
    # of the last 8 at least ``start_ms`` + 50 ms after the document's last change), so an editor
    # that asks at once (VS Code) or only when the user invokes it starts nothing; "always";
    # "never".
    start_ahead: str = field(default="auto", metadata=_choice("auto", "always", "never"))
    start_ms: int = field(default=50, metadata=_range(1, 2000))
    # A multi-line completion still being made this many ms after its request came is answered
    # with the whole lines it has written by then (as soon as it has one); the run goes on, and
    # the next request at the cursor (once the user accepts those lines or types them) takes its
    # rest, as a run typed along (``type_along`` must be on).  0: wait for the whole completion.
    # 150: measured (bench/results/first_lines_avx2) to halve the slowest waits where the user
    # stops, with as many completions accepted.
    first_lines_ms: int = field(default=150, metadata=_range(0, 60000))
    # Complete while typing with the cursor inside a word (``pri|nt``): off, as text inserted
    # there splits the word.  A request the user invokes is answered there either way.
    inside_word: bool = False


@dataclass
class EngineConfig:
    kv_budget_mb: int = field(default=512, metadata=_range(0, 1 << 20))  # 0: no reuse across requests
    efim: bool = True  # EFIM prompts while the prefix grows (FIM models)
    inc_bound: int = field(default=256, metadata=_range(0, 4096))  # EFIM inc tokens before a rebase
    head_lines: int = field(default=8, metadata=_range(0, 64))  # lines after <M> in a new session's prompt
    # While idle, prefill the prefix window's next opening when the window's start (on its
    # 16-line grid) moves within this many more characters typed: the request or EFIM rebase
    # after the move then prefills only the lines since, not the whole window.  0: off.
    ahead_chars: int = field(default=600, metadata=_range(0, 100_000))
    # A warm-up or ahead prefill checks for a request between pieces of about this many ms (at the
    # speed its last pieces ran; multiples of 32 tokens, at most 256): a request that comes meanwhile
    # waits for the piece in flight.  0: pieces of 256 tokens.
    warm_piece_ms: int = field(default=100, metadata=_range(0, 10_000))
    max_batch: int = field(default=16, metadata=_range(1, 256))  # requests decoded together
    # the KV cache's dtype; auto: see docs/decisions.md
    kv_dtype: str = field(default="auto", metadata=_choice("auto", "float32", "bfloat16", "float16"))


@dataclass
class IndexConfig:
    enabled: bool = True  # index the repository and watch it
    watch: bool = True  # a watchdog observer; off: the start-up scan and open buffers only
    max_file_bytes: int = field(default=1_000_000, metadata=_range(1024, None))
    max_files: int = field(default=100_000, metadata=_range(1, None))  # a larger folder: the first this many
    # the draft index (suffix arrays) starts with at most this many tokens, of the most recently
    # modified files: ~6 bytes a token in memory, ~60 while it is built
    max_draft_tokens: int = field(default=32_000_000, metadata=_range(1000, None))
    debounce_ms: int = field(default=50, metadata=_range(0, 10000))  # quiet time before a reconcile
    # background indexing waits while a completion is computed, at most this long at a time (0: never)
    yield_ms: int = field(default=500, metadata=_range(0, 60000))
    common: bool = True  # the common-code datastore (built once per tokenizer, memory-mapped)
    snippet_budget_ms: int = field(default=40, metadata=_range(1, 5000))
    # the client's other workspace folders (multi-root workspaces) are indexed too
    workspace_folders: bool = True
    max_folders: int = field(default=8, metadata=_range(1, 64))  # folders indexed at most, the repository's included


@dataclass
class SpeculationConfig:
    """Retrieval speculation (issue #8): drafts from the repository, the common datastore
    and a cache of verified outputs, checked by the model in one pass; the output is
    the greedy output either way.  Defaults tuned by bench/speculation.py."""

    enabled: bool = True
    max_nodes: int = field(default=3, metadata=_range(1, 512))  # draft tokens verified per step
    depth: int = field(default=15, metadata=_range(1, 32))  # longest draft
    max_rows: int = field(default=0, metadata=_range(0, 64))  # a pass's rows at most; 0: auto (8 on AVX2-only CPUs)
    # where passes are costly (bf16 on AVX2-only CPUs), datastore drafts need a match this long (0: off)
    costly_min_match: int = field(default=8, metadata=_range(0, 64))
    top_k: int = field(default=8, metadata=_range(1, 64))  # continuations per source
    alpha: float = field(default=1.0, metadata=_range(0, None))  # repository weight
    beta: float = field(default=0.5, metadata=_range(0, None))  # common datastore weight
    gamma: float = field(default=1.5, metadata=_range(0, None))  # verified cache weight
    delta: float = field(default=1.0, metadata=_range(0, None))  # weight of the request's own tokens
    use_live: bool = True  # draft from the request's own prompt and output (prompt lookup)
    live_chain: int = field(default=3, metadata=_range(0, 64))  # own tokens match this far back: a chain (0: off)
    tau: int = field(default=8, metadata=_range(0, None))  # cache first once it holds more sequences
    p: float = field(default=1.0, metadata=_range(0, 1))  # retrieval probability at a line's first token


@dataclass
class EarlyExitConfig:
    """Early exit (issue #9): confident tokens leave the layer stack early.  Off by
    default (it changes outputs unless lossless); needs exit heads (the default model
    ships them; others: python -m codecomplete.model.exit_train)."""

    enabled: bool = False
    measure: str = field(default="softmax", metadata=_choice("softmax", "cosine", "classifier"))
    threshold: float = field(default=0.0, metadata=_range(0, None))  # >0: one threshold everywhere; 0: calibrated
    bound: float = field(default=0.02, metadata=_range(0, 1))  # calibrated for this token disagreement
    layers: str = ""  # exit points to use, e.g. "16,24"; "": every calibrated exit
    batch_rule: str = field(default="all", metadata=_choice("each", "all"))
    max_batch: int = field(default=1, metadata=_range(1, 1024))  # exits only while at most this many requests decode
    decay: float = field(default=0.0, metadata=_range(0, None))  # CALM's schedule; 0: constant thresholds
    lossless: bool = False  # self-speculation: exact output of the full model
    draft_layer: int = field(default=0, metadata=_range(0, 512))  # lossless: the drafting exit (0: middle one)
    draft_tokens: int = field(default=4, metadata=_range(1, 32))  # lossless: most drafts per verification
    draft_bound: float = field(default=0.02, metadata=_range(0, 1))  # lossless: draft while confident at this bound
    path: str = ""  # exit heads folder; "": the ones stored with the model


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    completion: CompletionConfig = field(default_factory=CompletionConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    index_dir: str = ""  # "" -> the user cache directory keyed by the repository path
    log_level: str = field(default="info", metadata=_choice("debug", "info", "warning", "error"))


def _coerce(value: Any, typ: type, meta: dict) -> Any:
    """Return ``value`` as ``typ`` or raise ``ValueError`` with the reason."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            num = int(value) if not isinstance(value, float) or value.is_integer() else None
        except ValueError:
            num = None
        if num is None:
            raise ValueError(f"expected an integer, got {value!r}")
        lo, hi = meta.get("min"), meta.get("max")
        if (lo is not None and num < lo) or (hi is not None and num > hi):
            raise ValueError(f"{num} is outside [{lo}, {hi if hi is not None else '∞'}]")
        return num
    if typ is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            num = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
        if num != num:
            raise ValueError("expected a number, got NaN")
        lo, hi = meta.get("min"), meta.get("max")
        if (lo is not None and num < lo) or (hi is not None and num > hi):
            raise ValueError(f"{num} is outside [{lo}, {hi if hi is not None else '∞'}]")
        return num
    if typ is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        choices = meta.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value
    if typing.get_origin(typ) is tuple:  # tuple[str, ...]: a list, or "a, b" from a flag or an env
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ValueError(f"expected a list of strings, got {value!r}")
        return tuple(v for v in items if v)
    raise ValueError(f"unsupported type {typ}")


def merge(base: Any, data: dict, source: str, warnings: list[str], prefix: str = "") -> Any:
    """A copy of dataclass ``base`` with ``data`` applied; problems go to ``warnings``."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "settings"
        warnings.append(f"{source}: {where} must be a table, got {type(data).__name__}; keeping it as it was")
        return base
    hints = get_type_hints(type(base))
    fields = {f.name: f for f in dataclasses.fields(base)}
    changes = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        # camelCase from editors: maxTokens -> max_tokens
        name = "".join("_" + c.lower() if c.isupper() else c for c in name)
        path = f"{prefix}{key}"
        if name not in fields:
            warnings.append(f"{source}: unknown setting {path!r} ignored")
            continue
        typ = hints[name]
        current = getattr(base, name)
        if dataclasses.is_dataclass(current):
            changes[name] = merge(current, value, source, warnings, prefix=f"{path}.")
            continue
        try:
            changes[name] = _coerce(value, typ, dict(fields[name].metadata))
        except ValueError as exc:
            warnings.append(f"{source}: invalid {path}: {exc}; keeping {current!r}")
    return dataclasses.replace(base, **changes)


def read_toml(path: Path, warnings: list[str]) -> dict:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        warnings.append(f"{path}: unreadable config file ignored ({exc})")
        return {}


def user_config_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_config_dir("codecomplete")) / "config.toml"


def editor_settings(options: Any) -> dict:
    """The part of initializationOptions/didChangeConfiguration that is ours."""
    if not isinstance(options, dict):
        return {}
    if "codecomplete" not in options:
        return options
    inner = options["codecomplete"]
    # An empty Lua table arrives as [] from Neovim: no settings.
    return inner if isinstance(inner, dict) else {}


def parse_set(items: list[str], *, section: bool = False) -> dict:
    """``--set`` flags as a config mapping: ``["completion.max_tokens=32", "log_level=debug"]``
    -> ``{"completion": {"max_tokens": 32}, "log_level": "debug"}``.  VALUE is read as JSON
    (numbers, true/false, lists), else taken as a string.  ``section``: every key must name a
    section (SECTION.KEY).  Raises ``ValueError`` saying what was expected; the keys and values
    themselves are checked by ``merge`` (an unknown key or a bad value: a warning)."""
    import json

    out: dict = {}
    for item in items:
        key, eq, raw = item.partition("=")
        parts = [part.strip() for part in key.split(".")]
        if not eq or not all(parts) or (section and len(parts) < 2):
            raise ValueError(f"--set {item!r}: expected {'SECTION.KEY' if section else '[SECTION.]KEY'}=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        table = out
        for part in parts[:-1]:
            inner = table.setdefault(part, {})
            if not isinstance(inner, dict):
                raise ValueError(f"--set {item!r}: {part!r} was set to a value above, not a section")
            table = inner
        if isinstance(table.get(parts[-1]), dict):
            raise ValueError(f"--set {item!r}: {parts[-1]!r} is a section, not a setting")
        table[parts[-1]] = value
    return out


def deep_update(base: dict, over: dict) -> dict:
    """``base`` with ``over`` applied, section by section (a copy; neither is changed)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def load_config(repo: Path | None, cli: dict | None = None,
                user_file: Path | None = None) -> tuple[Config, list[str]]:
    """Defaults <- user file <- repo file <- command line."""
    warnings: list[str] = []
    cfg = Config()
    files = [user_file or user_config_path()]
    if repo is not None:
        files.append(repo / REPO_CONFIG)
    if user_file is not None and not user_file.is_file():  # named on purpose: say so
        warnings.append(f"{user_file}: config file not found; using the defaults")
    for path in files:
        data = read_toml(path, warnings)
        if data:
            cfg = merge(cfg, data, str(path), warnings)
    if cli:
        cfg = merge(cfg, cli, "command line", warnings)
    return cfg, warnings


def as_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def engine_settings(cfg: Config):
    """The engine's view of the configuration (a torch-free value)."""
    from codecomplete.model.api import EngineSettings, ExitSettings, SpecSettings

    m, c, e, sp = cfg.model, cfg.completion, cfg.engine, cfg.speculation
    return EngineSettings(model=m.name, device=m.device, dtype=m.dtype, template=m.template,
                          threads=m.threads, adaptive_threads=m.adaptive_threads, pack_weights=m.pack_weights,
                          native_attention=m.native_attention, weights=m.weights,
                          max_prefix_tokens=c.max_prefix_tokens,
                          max_suffix_tokens=c.max_suffix_tokens, token_healing=c.token_healing,
                          kv_budget_mb=e.kv_budget_mb, efim=e.efim, inc_bound=e.inc_bound, head_lines=e.head_lines,
                          ahead_chars=e.ahead_chars, warm_piece_ms=e.warm_piece_ms,
                          max_batch=e.max_batch, kv_dtype=e.kv_dtype,
                          speculation=SpecSettings(**dataclasses.asdict(sp)),
                          early_exit=ExitSettings(**dataclasses.asdict(cfg.early_exit)))
