"""``codecomplete-daemon record --out FILE [daemon args]``: an LSP proxy on stdio.

The editor starts this command instead of the daemon.  Every message passes through
unchanged in both directions; the client's document and completion traffic is written
to FILE as a v1 session when the editor goes away (ground truth for each request is
derived from what the user typed afterwards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from .sessions import Session, fill_truth, make_header, write_sessions


def read_frame(stream: BinaryIO) -> tuple[bytes, bytes] | None:
    """One LSP frame: (raw header + body bytes, body), or None at end of stream."""
    header = b""
    length = None
    while True:
        line = stream.readline()
        if not line:
            return None
        header += line
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode("ascii", "replace").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    if length is None:
        return header, b""
    body = stream.read(length)
    return header + body, body


class Recorder:
    def __init__(self, repo: Path | None):
        self.t0 = time.monotonic()
        self.repo = repo
        self.client = ""
        self.events: list[dict] = []
        self.lock = threading.Lock()

    def t(self) -> int:
        return round((time.monotonic() - self.t0) * 1000)

    def client_message(self, body: bytes) -> None:
        try:
            msg = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return
        if not isinstance(msg, dict):
            return
        method, p = msg.get("method"), msg.get("params") or {}
        event = None
        if method == "initialize":
            info = p.get("clientInfo") or {}
            self.client = f"{info.get('name', '?')} {info.get('version', '')}".strip()
            if self.repo is None and p.get("rootUri", "").startswith("file://"):
                self.repo = Path(p["rootUri"][7:])
        elif method == "textDocument/didOpen":
            d = p["textDocument"]
            event = {"type": "open", "uri": d["uri"], "languageId": d.get("languageId", ""), "text": d["text"]}
        elif method == "textDocument/didChange":
            event = {"type": "change", "uri": p["textDocument"]["uri"], "changes": p["contentChanges"]}
        elif method == "textDocument/inlineCompletion":
            ctx = p.get("context") or {}
            event = {"type": "request", "uri": p["textDocument"]["uri"], "line": p["position"]["line"],
                     "character": p["position"]["character"],
                     "trigger": "invoked" if ctx.get("triggerKind") == 1 else "automatic"}
        elif method == "codecomplete/didMoveCursor" and isinstance(p.get("position"), dict):
            event = {"type": "cursor", "uri": (p.get("textDocument") or {}).get("uri", ""),
                     "line": p["position"].get("line"), "character": p["position"].get("character")}
        elif method in ("textDocument/didSave", "textDocument/didClose"):
            event = {"type": method.rsplit("did", 1)[1].lower(), "uri": p["textDocument"]["uri"]}
        elif method == "workspace/executeCommand" and p.get("command") == "codecomplete.accept":
            args = p.get("arguments") or [{}]
            event = {"type": "accept", "uri": (args[0] or {}).get("uri", "")}
        elif method == "codecomplete/didRejectCompletion":
            event = {"type": "reject", "uri": p.get("uri", "")}
        if event is not None:
            with self.lock:
                self.events.append({"t": self.t(), **event})

    def session(self) -> Session:
        commit = ""
        if self.repo is not None:
            out = subprocess.run(["git", "-C", str(self.repo), "rev-parse", "HEAD"], capture_output=True, text=True)
            commit = out.stdout.strip() if out.returncode == 0 else ""
        s = Session(make_header(str(self.repo or ""), commit, self.client, "recorded"), list(self.events))
        fill_truth(s)
        return s


def record(argv: list[str]) -> int:
    if "--out" not in argv or argv.index("--out") + 1 >= len(argv):
        print("usage: codecomplete-daemon record --out FILE [daemon args]", file=sys.stderr)
        return 2
    i = argv.index("--out")
    out = Path(argv[i + 1])
    daemon_args = argv[:i] + argv[i + 2:]
    repo = None
    if "--repo" in daemon_args and daemon_args.index("--repo") + 1 < len(daemon_args):
        repo = Path(daemon_args[daemon_args.index("--repo") + 1]).resolve()
    rec = Recorder(repo)
    proc = subprocess.Popen([sys.executable, "-m", "codecomplete.daemon", *daemon_args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    editor_in, editor_out = sys.stdin.buffer, sys.stdout.buffer

    def to_editor() -> None:
        while True:
            frame = read_frame(proc.stdout)
            if frame is None:
                return
            editor_out.write(frame[0])
            editor_out.flush()

    def to_daemon() -> None:
        while True:
            frame = read_frame(editor_in)
            if frame is None:
                break
            rec.client_message(frame[1])
            try:
                proc.stdin.write(frame[0])
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                break
        try:
            proc.stdin.close()  # the editor went away: the daemon sees end of input
        except OSError:
            pass

    pump = threading.Thread(target=to_editor, daemon=True)
    pump.start()
    threading.Thread(target=to_daemon, daemon=True).start()
    try:
        proc.wait()  # the daemon exits after the editor's exit (or end of input)
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
    finally:
        pump.join(timeout=2)
        write_sessions(out, [rec.session()])
        print(f"recorded {len(rec.events)} events to {out}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # A thread may still block reading the editor's stdin: leave without waiting for it.
    os._exit(proc.returncode or 0)
