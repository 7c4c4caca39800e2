"""Several repository roots in one daemon: an editor's multi-root workspace.

VS Code's multi-root workspaces, Zed's and Sublime's projects and Neovim's
``vim.lsp.buf.add_workspace_folder`` give one language server several folders.  Each
folder gets its own :class:`RepoIndex` (its own SQLite file and watcher); this class
routes a path to the index of the folder that holds it, and answers the engine's draft
lookups and the prompt's snippet searches over all of them:

- drafts: one suffix-array search over every folder's segments, so the longest match
  anywhere wins (FastCoder's repository datastore, spanning the folders); the common
  datastore is the first folder's;
- snippets: the file's own folder first, then the others with what is left of the time
  budget.  Order: the own folder's definitions, other folders' definitions of names the
  file calls or imports, the own folder's similar chunks, then the rest.  Another folder's
  definition of a name the own folder defines is dropped (``value`` in one project is
  not ``value`` in the next).  A snippet from another folder is named
  ``folder-name/relative/path``.

A folder inside an indexed one, or one that holds an indexed one, is not indexed again
(its files are already, or it would index them twice); more than ``max_folders`` are
not indexed either.  Both are logged.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from . import snippets as snip
from .suffix import Match

log = logging.getLogger("codecomplete.index")


DEF = "definition of "
_CALLED = re.compile(r"(?<![\w$.])([A-Za-z_$][\w$]*)\s*\(")  # not a method: obj.items() is anyone's
_IMPORT_LINE = re.compile(r"^\s*(?:from\s|import\s|#\s*include|use\s|using\s|require|.*\brequire\s*\().*$", re.M)


def _referenced(text: str) -> set[str]:
    """Names the text calls (not as methods) or imports: another folder's definition of
    one of them is probably what the file uses (its own folder does not define it).  A
    name merely used, such as a variable ``value``, or a method called, such as
    ``.items()``, is not: a definition elsewhere is likely someone else's."""
    names = set(_CALLED.findall(text))
    for line in _IMPORT_LINE.findall(text):
        names.update(re.findall(r"[A-Za-z_$][\w$]*", line))
    return names


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class Folders:
    """The indexes of a workspace's folders; the first one added is the primary."""

    def __init__(self, make: Callable[[Path, bool], object], max_folders: int = 8):
        self._make = make  # (root, primary) -> a started RepoIndex
        self.max_folders = max_folders
        self._lock = threading.Lock()
        self._roots: dict[str, object] = {}  # real path -> RepoIndex, the primary first
        self._tokenizer = None

    # -- membership ----------------------------------------------------------------------
    @property
    def primary(self):
        with self._lock:
            return next(iter(self._roots.values()), None)

    def all(self) -> list:
        with self._lock:
            return list(self._roots.values())

    def add(self, root: Path) -> object | None:
        """Index ``root`` (a directory); None when it is not indexed (see the module)."""
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            log.warning("workspace folder %s is not a directory; not indexed", root)
            return None
        with self._lock:
            if real in self._roots:
                return self._roots[real]
            for other in self._roots:
                if _inside(real, other) or _inside(other, real):
                    log.info("workspace folder %s overlaps the indexed %s; not indexed again", real, other)
                    return None
            if len(self._roots) >= self.max_folders:
                log.warning("workspace folder %s not indexed: %d folders are (index.max_folders)",
                            real, self.max_folders)
                return None
            primary = not self._roots
            index = self._make(Path(real), primary)
            self._roots[real] = index
            tokenizer = self._tokenizer
        if tokenizer is not None:
            index.set_tokenizer(tokenizer)
        return index

    def remove(self, root: Path) -> bool:
        """Stop indexing ``root`` (not the primary: it serves the common datastore)."""
        real = os.path.realpath(root)
        with self._lock:
            index = self._roots.get(real)
            if index is None or index is next(iter(self._roots.values())):
                return False
            del self._roots[real]
        index.close(timeout=2)
        log.info("workspace folder %s removed; its index closed", real)
        return True

    def close_secondary(self) -> None:
        """Close every folder's index but the primary (a TCP client left)."""
        primary = self.primary
        for index in self.all():
            if index is not primary:
                self.remove(index.root)

    def close(self, timeout: float = 2.0) -> None:
        with self._lock:
            indexes, self._roots = list(self._roots.values()), {}
        for index in indexes:
            index.close(timeout=timeout)

    def set_tokenizer(self, tokenizer) -> None:
        with self._lock:
            self._tokenizer = tokenizer
            indexes = list(self._roots.values())
        for index in indexes:
            index.set_tokenizer(tokenizer)

    def for_path(self, path: str | Path):
        """The index of the folder holding ``path`` (the innermost), else the primary."""
        real = os.path.realpath(path) if os.path.isabs(path) else str(path)
        with self._lock:
            best, best_len = None, -1
            for root, index in self._roots.items():
                if _inside(real, root) and len(root) > best_len:
                    best, best_len = index, len(root)
            return best if best is not None else next(iter(self._roots.values()), None)

    # -- what the engine and the prompt ask --------------------------------------------
    def lookup(self, context: list[int], **kw) -> list[Match]:
        """Draft continuations: the longest context suffix over every folder's tokens,
        and the primary's common datastore."""
        indexes = self.all()
        if not indexes:
            return []
        if len(indexes) == 1:
            return indexes[0].lookup(context, **kw)
        return indexes[0].lookup(context, others=tuple(i.drafts for i in indexes[1:]), **kw)

    def snippets(self, path: str | Path, text: str, offset: int, *, limit: int = 3,
                 budget_ms: float = 40.0) -> list[snip.Snippet]:
        own = self.for_path(path)
        if own is None:
            return []
        indexes = [own] + [i for i in self.all() if i is not own]
        if len(indexes) == 1:
            return own.snippets(path, text, offset, limit=limit, budget_ms=budget_ms)
        deadline = time.perf_counter() + budget_ms / 1000
        found = []  # (rank, snippet)
        referenced = None
        for index in indexes:
            left_ms = (deadline - time.perf_counter()) * 1000
            if left_ms <= 1:
                break
            try:
                got = index.snippets(path, text, offset, limit=limit, budget_ms=left_ms)
                if index is not own:
                    defined = {sn.reason[len(DEF):] for sn in got if sn.reason.startswith(DEF)}
                    defined = own.defines(sorted(defined)) if defined else set()
            except Exception as exc:  # e.g. its folder was removed (the index closed) meanwhile
                log.warning("snippets from %s failed: %s", index.root, exc)
                continue
            for sn in got:
                if index is own:
                    found.append((0 if sn.reason.startswith(DEF) else 2, sn))
                    continue
                name = sn.reason[len(DEF):] if sn.reason.startswith(DEF) else None
                if name in defined:
                    continue  # the file's own folder defines that name: another's is someone else's
                if name is not None and referenced is None:
                    referenced = _referenced(text[max(0, offset - 20000):offset])
                rank = 3 if name is None else (1 if name in referenced else 3)
                found.append((rank, replace(sn, path=f"{index.root.name}/{sn.path}")))
        found.sort(key=lambda r: r[0])  # stable: the own folder first within a rank
        return [sn for _, sn in found[:limit]]

    def stats(self) -> list[dict]:
        return [index.stats() for index in self.all()]
