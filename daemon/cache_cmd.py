"""``codecomplete-daemon cache``: what the cache folder holds, and ``--prune`` for what no start reads.

The daemon builds everything it keeps (converted and merged checkpoints, compiled kernels, packed
weights, one index per repository, the common datastores), and removes what a newer build replaces
as it goes.  What it cannot see from one start is what other starts left: the index of a
repository since deleted or moved, kernels compiled for an older version, packed weights of a
checkpoint that is gone.  Each of those stays until removed by hand, and an index can hold
hundreds of MB.  This command lists every entry with its size and whether it is *stale*, and
``--prune`` removes the stale ones:

- ``index/NAME-KEY``: stale where the repository it records (its ``meta`` table) no longer exists,
  or the folder has held no database for 10 minutes;
- ``codecomplete_native-KEY.so``: stale where it is not this installation's build for this CPU
  (another version's sources or flags; on a cache shared by machines with other CPUs, theirs: they
  compile it again at their next start);
- ``packed/KEY.pack``: stale where its checkpoint folder is gone; a temporary file older than
  10 minutes too (a process stopped while writing it);
- ``models/NAME-KEY``: stale where an input named in its ``SOURCE`` (the GGUF it was converted
  from, the adapter it merges) no longer exists, unless the folder holds a folder of its own (exit
  heads a user trained for it).  A merge's base is not counted: the default model's is a
  conversion removed after the merge;
- ``common/TOKENIZER`` and anything else: listed, never stale.

Nothing here loads a model or imports torch.  A daemon still running on a pruned index keeps its
open files and the next start builds the index again: everything in the cache is derived data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path

STALE_TMP_S = 600.0  # an index folder without its database this long was not being created


@dataclass
class Entry:
    kind: str  # index, native, packed, model, common, other
    path: str
    bytes: int
    stale: bool
    status: str  # what it is for, or why it is stale


def _size(p: Path) -> int:
    try:
        if p.is_symlink() or p.is_file():
            return p.lstat().st_size
        return sum(f.lstat().st_size for f in p.rglob("*") if not f.is_dir() or f.is_symlink())
    except OSError:
        return 0


def _index_repo(db: Path) -> str | None:
    """The repository an index records (``meta.repo``), read without writing; None if unreadable."""
    where = "file:" + urllib.parse.quote(str(db.absolute()))  # a path may hold '?', '#' or '%'
    for uri in (where + "?mode=ro", where):
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=2.0)
            try:
                row = conn.execute("SELECT value FROM meta WHERE key = 'repo'").fetchone()
                return row[0] if row else None
            finally:
                conn.close()
        except sqlite3.Error:
            continue
    return None


def _index_entry(d: Path) -> Entry:
    db = d / "index.sqlite"
    size = _size(d)
    if not db.is_file():  # a daemon starting on a new repository makes the folder, then the database
        old = time.time() - d.stat().st_mtime > STALE_TMP_S
        return Entry("index", str(d), size, old, "no database in it" if old else "being created")
    repo = _index_repo(db)
    if repo is None:
        return Entry("index", str(d), size, False, "unreadable: the daemon rebuilds it when its repository opens")
    if not Path(repo).is_dir():
        return Entry("index", str(d), size, True, f"repository gone: {repo}")
    return Entry("index", str(d), size, False, f"repository {repo}")


def _native_entries(root: Path) -> list[Entry]:
    from codecomplete.model import native_build

    try:
        current = native_build.library_path().name
    except OSError:
        current = None
    out = []
    for p in sorted(root.glob("codecomplete_native-*.so")):
        mine = p.name == current
        out.append(Entry("native", str(p), _size(p), not mine,
                         "this installation's kernels for this CPU" if mine else "another build's kernels"))
    return out


def _packed_entries(folder: Path, now: float) -> list[Entry]:
    from codecomplete.model.pack_prefetch import classify  # the rule packcache's own clean-up follows

    status = {"tmp": "being written", "tmp-left": "left by a stopped write",
              "damaged": "not a packed weights' file (damaged)"}
    out = []
    for p in sorted(folder.iterdir()):
        kind, ckpt = classify(p, now)
        if kind == "pack":
            what = f"packed weights of {ckpt}"
        elif kind == "gone":
            what = f"checkpoint gone: {ckpt}"
        elif kind == "other":
            what = "read-ahead hints" if p.name == "hints.json" else "other"
        else:
            what = status[kind]
        out.append(Entry("packed", str(p), _size(p), kind in ("tmp-left", "gone", "damaged"), what))
    return out


# SOURCE lines naming an input the folder's key is made from.  A merge's "base" line is left out:
# the default model's base is a conversion made for the merge and removed after it, by design.
_SOURCE_KINDS = ("converted from ", "adapter ")


def _model_entries(folder: Path) -> list[Entry]:
    """Checkpoints; stale where an input named in SOURCE is gone and no folder was added to it
    (the rule ``paths.prune_replaced`` applies when a new build replaces one)."""
    from codecomplete.paths import holds_folder, source_refs

    out = []
    for d in sorted(folder.iterdir()):
        if not d.is_dir():
            out.append(Entry("model", str(d), _size(d), False, "other"))
            continue
        try:
            refs = source_refs(d, _SOURCE_KINDS)
        except (OSError, ValueError):
            refs = []
        try:
            added = holds_folder(d)
        except OSError:
            added = True
        gone = [r for r in refs if not Path(r).exists()]
        if gone and not added:
            out.append(Entry("model", str(d), _size(d), True, f"input gone: {gone[0]}"))
            continue
        what = "checkpoint" + (f" from {refs[-1]}" if refs else "")
        what += " (with a folder added to it)" if added else ""
        out.append(Entry("model", str(d), _size(d), False, what))
    return out


def scan(root: Path) -> list[Entry]:
    """Every entry of the cache folder ``root``, each with its size and whether it is stale."""
    now = time.time()
    out: list[Entry] = []
    if not root.is_dir():
        return out
    for p in sorted(root.iterdir()):
        try:
            if p.name == "index" and p.is_dir():
                out += [_index_entry(d) if d.is_dir() else Entry("index", str(d), _size(d), False, "other")
                        for d in sorted(p.iterdir())]
            elif p.name == "packed" and p.is_dir():
                out += _packed_entries(p, now)
            elif p.name == "models" and p.is_dir():
                out += _model_entries(p)
            elif p.name == "common" and p.is_dir():
                out += [Entry("common", str(d), _size(d), False, "common datastore for a tokenizer")
                        for d in sorted(p.iterdir())]
            elif p.name.startswith("codecomplete_native-") and p.suffix == ".so":
                continue  # below, with the current build's name
            else:
                out.append(Entry("other", str(p), _size(p), False, "other"))
        except OSError as e:  # a folder vanishing or unreadable while listed
            out.append(Entry("other", str(p), 0, False, f"unreadable: {e}"))
    out += _native_entries(root)
    native_dir = _native_dir()
    if native_dir is not None and native_dir.resolve() != root.resolve() and native_dir.is_dir():
        out += _native_entries(native_dir)  # kernels kept elsewhere (CODECOMPLETE_NATIVE_DIR)
    return out


def _native_dir() -> Path | None:
    """Where this installation keeps its kernels when not in the cache folder
    (``CODECOMPLETE_NATIVE_DIR``), else None."""
    if not os.environ.get("CODECOMPLETE_NATIVE_DIR"):
        return None
    from codecomplete.model import native_build

    return native_build.cache_dir()


def prune(entries: list[Entry]) -> tuple[list[Entry], list[tuple[Entry, str]]]:
    """Remove the stale entries; returns (removed, [(entry, error)])."""
    removed, failed = [], []
    for e in entries:
        if not e.stale:
            continue
        p = Path(e.path)
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
            removed.append(e)
        except OSError as err:
            failed.append((e, str(err)))
    return removed, failed


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def main(argv: list[str]) -> int:
    from codecomplete.paths import cache_dir

    p = argparse.ArgumentParser(prog="codecomplete-daemon cache", description=(
        "List what the cache folder holds (CODECOMPLETE_CACHE_DIR or the user cache folder), with sizes "
        "and what is stale: indexes of repositories that are gone, other builds' kernels, packed weights "
        "and checkpoints whose inputs are gone; kernels kept in CODECOMPLETE_NATIVE_DIR too. Indexes placed "
        "with --index-dir are not listed (nothing records where they are). --prune removes the stale entries."))
    p.add_argument("--prune", action="store_true", help="remove the stale entries")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    root = cache_dir()
    entries = scan(root)
    removed, failed = prune(entries) if args.prune else ([], [])
    if args.json:
        print(json.dumps({"cache": str(root), "entries": [asdict(e) for e in entries],
                          "removed": [e.path for e in removed],
                          "failed": [{"path": e.path, "error": err} for e, err in failed]}, indent=1))
        return 1 if failed else 0
    print(f"cache folder: {root}")
    for e in entries:
        mark = "stale" if e.stale else ""
        path = Path(e.path)
        shown = path.relative_to(root) if path.is_relative_to(root) else path  # kernels kept elsewhere
        print(f"  {e.kind:<7} {_mb(e.bytes):>12}  {mark:<5}  {shown}  ({e.status})")
    kinds: dict[str, list[Entry]] = {}
    for e in entries:
        kinds.setdefault(e.kind, []).append(e)
    for kind, group in kinds.items():
        stale = [e for e in group if e.stale]
        print(f"{kind}: {len(group)}, {_mb(sum(e.bytes for e in group))}"
              + (f" ({len(stale)} stale, {_mb(sum(e.bytes for e in stale))})" if stale else ""))
    total = sum(e.bytes for e in entries)
    stale = [e for e in entries if e.stale]
    print(f"{len(entries)} entries, {_mb(total)}; {len(stale)} stale, {_mb(sum(e.bytes for e in stale))}")
    if args.prune:
        print(f"removed {len(removed)}, {_mb(sum(e.bytes for e in removed))}")
        for e, err in failed:
            print(f"could not remove {e.path}: {err}", file=sys.stderr)
    elif stale:
        print("codecomplete-daemon cache --prune removes the stale entries")
    return 1 if failed else 0
