"""The ``codecomplete-daemon`` command.

``codecomplete-daemon --repo PATH`` serves LSP on stdio (or ``--tcp HOST:PORT``).
Subcommands: ``complete`` prints one completion for a file position; ``cache`` lists the cache
folder (``--prune`` removes what no start reads).
Logs go to stderr or ``--log-file``; stdout belongs to the LSP channel.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import sys
import time
from pathlib import Path

from codecomplete import __version__

from . import startgc
from .config import Config, deep_update, engine_settings, load_config, parse_set
from .logs import setup_logging

log = logging.getLogger("codecomplete")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", type=Path, default=None, help="repository root (default: the LSP client's root)")
    p.add_argument("--model", help="'default', a Hugging Face checkpoint directory, a .gguf file "
                                   "or a hub id already in the local cache")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--index-dir", help="where the repository index lives (default: user cache dir)")
    p.add_argument("--config", type=Path, default=None, help="a config file instead of the user one")
    p.add_argument("--log-file", help="write logs here instead of stderr")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v debug, -vv protocol too")
    p.add_argument("--set", action=SetAction, default=[], metavar="[SECTION.]KEY=VALUE",
                   help="any setting, over every other source (repeatable; e.g. completion.max_tokens=32; "
                        "VALUE is read as JSON, else as a string); the flags above win over it")


class SetAction(argparse.Action):
    """``--set``, repeatable: each flag's form, and the flags so far together (one may not make a
    section of another's setting), checked as argparse reads them, so a mistake is a usage error
    at start (its key and value are checked by ``merge``: a warning)."""

    def __call__(self, parser, namespace, value, option_string=None):
        items = [*(getattr(namespace, self.dest, None) or []), value]
        try:
            parse_set(items)
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, items)


def cli_settings(args: argparse.Namespace) -> dict:
    """The flags that override configuration, as a config mapping: ``--set`` ones, then the
    named flags (--model, --device, --dtype, --index-dir) over them."""
    model = {k: v for k, v in (("name", args.model), ("device", args.device), ("dtype", args.dtype)) if v}
    out: dict = {"model": model} if model else {}
    if args.index_dir:
        out["index_dir"] = args.index_dir
    return deep_update(parse_set(getattr(args, "set", None) or []), out)


def build_config(args: argparse.Namespace) -> Config:
    cfg, warnings = load_config(args.repo, cli_settings(args), user_file=args.config)
    for w in warnings:
        log.warning("%s", w)
    return cfg


def parse_tcp(value: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT``; a bare port binds loopback only."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tcp wants HOST:PORT or PORT, got {value!r}") from None
    if not 0 <= number < 65536:
        raise argparse.ArgumentTypeError(f"port {number} out of range")
    return host, number


def serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="codecomplete-daemon", description=(
        "Serve inline code completions over the Language Server Protocol. "
        "Subcommands: complete (one completion from the terminal), index (build the repository index), "
        "sessions from-git, replay, record (the replay harness), cache (what the cache holds; --prune)."))
    _common(p)
    p.add_argument("--tcp", type=parse_tcp, metavar="HOST:PORT",
                   help="listen on TCP instead of stdio (a bare PORT binds 127.0.0.1)")
    p.add_argument("--version", action="version", version=f"codecomplete-daemon {__version__}")
    p.add_argument("--record", metavar="FILE", help="record this editing session to FILE (replay harness)")
    args = p.parse_args(argv)
    lsp_out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but LSP messages may reach the real stdout
    setup_logging(args.verbose, args.log_file)
    if args.repo is not None and not args.repo.is_dir():
        log.warning("--repo %s is not a directory; serving without a repository", args.repo)
        args.repo = None
    cfg = build_config(args)
    # Tokenizing in batches (the index, the common datastore) is background work, on threads
    # below the engine's priority; the tokenizers library would hand it to a pool of its own at
    # normal priority, one thread a core, which took the cores from the first completions while a
    # first start built the common datastore (prefill 1.4 -> 0.8 s, decode 47 -> 11 ms a token,
    # docs/decisions.md).  Read at each call by the library; a user's own setting stands.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    startgc.pause()  # the start's imports without the collector (daemon/startgc.py); on again once loaded
    from codecomplete.model.handle import EngineHandle

    # torch is imported and the model loads on the engine's threads while the client connects
    # and is answered (model/handle.py); started first, as the first completion waits for it
    engine = EngineHandle(engine_settings(cfg))
    startgc.resume_once_loaded(engine)
    engine.start()
    from codecomplete.lsp.server import create_server

    server = create_server(engine, cfg, args.repo.resolve() if args.repo else None, cli_settings(args))
    log.info("codecomplete-daemon %s, repo %s", __version__, args.repo)
    code = 0
    try:
        if args.tcp:
            host, port = args.tcp
            if not ipaddress.ip_address(host if host != "localhost" else "127.0.0.1").is_loopback:
                log.warning("listening on %s: reachable from other machines", host)
            server.serve_tcp(host, port)
        else:
            server.start_io(sys.stdin.buffer, lsp_out)
            code = server.protocol.exit_code or 0
    except SystemExit as exc:  # the client's exit: 0 after shutdown, else 1
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        if server.index is not None:
            server.index.close(timeout=2)
        engine.close(timeout=2)
        packed = sys.modules.get("codecomplete.model.packcache")  # imported where a model was loaded
        if packed is not None:
            packed.finish()  # a write of the packed weights in flight completes (os._exit skips atexit)
        log.info("codecomplete-daemon exits (%d)", code)
        # Exit now, without the interpreter's teardown: a client that leaves while the
        # model still loads would otherwise have its loader thread torn down under it
        # ("terminate called without an active exception", SIGABRT).
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)


def parse_location(value: str) -> tuple[Path, int, int | None]:
    """FILE:LINE[:COL], 1-based; no column means the end of the line."""
    parts = value.rsplit(":", 2)
    try:
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            return Path(parts[0]), int(parts[1]), int(parts[2])
        head, _, line = value.rpartition(":")
        return Path(head), int(line), None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FILE:LINE:COL, got {value!r}") from None


def complete(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="codecomplete-daemon complete",
                                description="Print one completion at FILE:LINE:COL (1-based).")
    _common(p)
    p.add_argument("location", type=parse_location, metavar="FILE:LINE:COL")
    p.add_argument("--json", action="store_true", help="print JSON with timings")
    p.add_argument("--mode", choices=["auto", "single", "multi"])
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--alternatives", type=int, default=1, metavar="N",
                   help="up to N completions: the greedy one, then others branching where the model is unsure "
                        "(what an editor's invoked request offers)")
    args = p.parse_args(argv)
    if not 1 <= args.alternatives <= 8:
        p.error("--alternatives must be 1-8")
    setup_logging(args.verbose, args.log_file, quiet=True)
    from codecomplete.indexer.files import SourceError, read_source
    from codecomplete.lsp.documents import PositionError, cursor_at, split_lines

    path, line, col = args.location
    if args.repo is None:
        args.repo = Path.cwd()
    if not path.is_absolute() and not path.exists():
        path = args.repo / path
    cfg = build_config(args)
    try:
        text = read_source(path, cfg.completion.max_document_bytes)
        lines = split_lines(text)  # as editors number lines
        if len(lines) > 1 and lines[-1] == "":
            lines.pop()  # a final newline does not start a line of its own
        if not 1 <= line <= len(lines):
            raise PositionError(f"line {line} is outside {path} (1-{len(lines)})")
        column = len(lines[line - 1]) if col is None else col - 1
        cursor = cursor_at(text, line - 1, column, "utf-32")
    except (SourceError, PositionError) as exc:
        print(f"codecomplete-daemon complete: {exc}", file=sys.stderr)
        return 2
    from codecomplete.model.api import CompletionRequest
    from codecomplete.model.handle import prestart

    settings = engine_settings(cfg)
    prestart(settings)  # the kernels' build (first run only) and the packed weights' read, while torch is imported
    startgc.pause()  # torch's import without the collector, as the daemon's start (daemon/startgc.py)
    from codecomplete.model.engine import Engine

    engine = Engine(settings)
    startgc.resume_once_loaded(engine)
    engine.start()
    c = cfg.completion
    request = CompletionRequest(cursor.prefix, cursor.suffix, request_id="cli",
                                mode=args.mode or c.mode, max_tokens=args.max_tokens or c.max_tokens,
                                max_lines=c.max_lines, time_budget_ms=c.time_budget_ms,
                                alternatives=args.alternatives)
    result = engine.complete(request)
    stats = engine.stats()
    engine.close()
    if result.error:
        print(f"codecomplete-daemon complete: {result.stop_reason}: {result.error}", file=sys.stderr)
        return 1
    others = [t for t in result.texts if t != result.text]  # --alternatives: the other completions
    if args.json:
        print(json.dumps({
            "file": str(path), "line": line, "column": column + 1, "text": result.text,
            "stop_reason": result.stop_reason, "multiline": result.multiline,
            "alternatives": others,
            "prompt_tokens": result.prompt_tokens, "generated_tokens": result.generated_tokens,
            "timings_ms": {k: round(v, 2) for k, v in result.timings.items()},
            "model": stats["model"], "device": stats["device"], "dtype": stats["dtype"],
            "template": stats["template"], "load_seconds": stats["load_seconds"]}, indent=2))
    else:
        print(result.text)
        for i, text in enumerate(others, 2):
            print(f"--- alternative {i}")
            print(text)
    return 0


def index(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="codecomplete-daemon index",
                                description="Build or update the repository index and print its stats.")
    _common(p)
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    p.add_argument("--no-tokens", action="store_true", help="skip token ids (no model tokenizer needed)")
    p.add_argument("--common", action="store_true",
                   help="also build the common-code datastore for the model's tokenizer")
    args = p.parse_args(argv)
    setup_logging(args.verbose, args.log_file, quiet=not args.verbose)
    repo = (args.repo or Path.cwd()).resolve()
    if not repo.is_dir():
        print(f"codecomplete-daemon index: {repo} is not a directory", file=sys.stderr)
        return 2
    cfg = build_config(args)
    from codecomplete.indexer.index import RepoIndex
    from codecomplete.indexer.progress import Progress

    tokenizer = None
    if not args.no_tokens:
        from codecomplete.model.loader import ModelLoadError, load_tokenizer

        try:
            tokenizer = load_tokenizer(cfg.model.name)
        except ModelLoadError as exc:
            print(f"codecomplete-daemon index: {exc}", file=sys.stderr)
            return 1
    idx = RepoIndex(repo, Path(cfg.index_dir) if cfg.index_dir else None, tokenizer=tokenizer,
                    max_file_bytes=cfg.index.max_file_bytes, max_files=cfg.index.max_files,
                    max_draft_tokens=cfg.index.max_draft_tokens, watch=False)
    t0 = time.perf_counter()
    with Progress("indexing", enabled=sys.stderr.isatty() and not args.json) as bar:
        idx.progress = bar.update
        stats = idx.build()
    seconds = time.perf_counter() - t0
    counts = idx.counts()
    out = {"repo": str(repo), "index": str(idx.db_path), "files": counts["files"], "tokens": counts["tokens"],
           "bytes": counts["bytes"], "chunks": counts["chunks"], "definitions": counts["definitions"],
           "seconds": round(seconds, 3), "files_indexed": stats["files_indexed"],
           "files_unchanged": stats["files_unchanged"], "files_removed": stats["files_removed"],
           "files_skipped": stats["files_skipped"], "skipped": stats["skipped"],
           "tokenize_seconds": stats["tokens_seconds"], "rebuilt_from": stats["rebuilt_from"]}
    if args.common and tokenizer is not None:
        from codecomplete.indexer.common import build_common, common_dir

        folder = common_dir(tokenizer)
        info = build_common(tokenizer, folder)
        out["common"] = {"path": str(folder), "tokens": info["tokens"], "files": info["documents"]}
    idx.close()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{out['files']} files, {out['tokens']} tokens, {out['bytes'] / 1e6:.1f} MB in "
              f"{out['seconds']:.1f} s ({out['files_indexed']} indexed, {out['files_unchanged']} unchanged, "
              f"{out['files_removed']} removed, {out['files_skipped']} skipped) -> {out['index']}")
        if "common" in out:
            print(f"common datastore: {out['common']['tokens']} tokens -> {out['common']['path']}")
    return 0


def sessions_cmd(argv: list[str]) -> int:
    from .sessions import ASKS, IDLE_MS, TYPING, SessionError, sessions_from_git, write_sessions

    p = argparse.ArgumentParser(prog="codecomplete-daemon sessions", description="Make editing sessions.")
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("from-git", help="typing sessions from a repository's commits")
    g.add_argument("repo", type=Path)
    g.add_argument("--commits", type=int, default=5, help="sessions to make (one per commit)")
    g.add_argument("--out", type=Path, default=Path("sessions.jsonl"))
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-files", type=int, default=3, help="changed files typed per commit")
    g.add_argument("--suffix", action="append", default=None, help="file suffixes to type (default .py)")
    g.add_argument("--skip", type=int, default=0, help="pass over the newest N commits that would make a session")
    g.add_argument("--typing", choices=TYPING, default=TYPING[0],
                   help="open-line (default): open an empty line, then type the new lines there, as in an editor; "
                        "in-place: type them, line breaks included, in front of the code that follows (the "
                        "sessions made before 2026-11-28)")
    g.add_argument("--pairs", action="store_true",
                   help="the editor closes brackets as their opener is typed (VS Code's default, Neovim's autopairs)")
    g.add_argument("--asks", choices=ASKS, default=ASKS[0],
                   help="where the editor asks for completions: pauses (default: at some word and line boundaries "
                        "where the typing stops), keys (after every character typed, as VS Code asks) or idle "
                        "(once no key came for --idle-ms after one, as Neovim's clients ask)")
    g.add_argument("--idle-ms", type=int, default=IDLE_MS,
                   help=f"--asks idle: the editor's wait after the last key (default {IDLE_MS}: Neovim 0.12's "
                        "built-in client; the Neovim plugin's own client waits 75)")
    args = p.parse_args(argv)

    skipped: list[tuple[str, str]] = []
    try:
        made = sessions_from_git(args.repo, args.commits, args.seed, args.max_files,
                                 tuple(args.suffix or [".py"]), skip=max(0, args.skip), typing=args.typing,
                                 pairs=args.pairs, asks=args.asks, idle_ms=args.idle_ms,
                                 skipped=skipped)
    except SessionError as exc:
        print(f"codecomplete-daemon sessions: {exc}", file=sys.stderr)
        return 2
    for sha, why in skipped:
        print(f"codecomplete-daemon sessions: passed over {sha[:12]}: {why}", file=sys.stderr)
    if not made:
        print("codecomplete-daemon sessions: no commit with a typable change found", file=sys.stderr)
        return 1
    write_sessions(args.out, made)
    print(f"{len(made)} sessions, {sum(len(s.requests) for s in made)} requests, "
          f"{sum(len(s.events) for s in made)} events -> {args.out}")
    return 0


def replay_cmd(argv: list[str]) -> int:
    from .replay import replay

    return replay(argv)


def record_cmd(argv: list[str]) -> int:
    from .record import record

    return record(argv)


def cache_cmd(argv: list[str]) -> int:
    from .cache_cmd import main as cache_main

    return cache_main(argv)


SUBCOMMANDS = {"complete": complete, "index": index, "sessions": sessions_cmd, "replay": replay_cmd,
               "record": record_cmd, "cache": cache_cmd}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    if "--record" in argv[:-1]:  # serve through the recorder (editors that only add arguments)
        i = argv.index("--record")
        return record_cmd(["--out", argv[i + 1], *argv[:i], *argv[i + 2:]])
    return serve(argv)


if __name__ == "__main__":
    raise SystemExit(main())
