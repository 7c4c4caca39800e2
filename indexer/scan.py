"""Walking a repository: which files the index holds.

Rules, in order: default excludes (VCS folders, virtual environments, dependency and
build folders), ``.git/info/exclude``, every ``.gitignore`` on the way down (a nested
one applies below its folder, later rules win, ``!`` re-includes), then per file: a size
cap, data/minified/lock files, binary content.  Symlinks are followed only when they
resolve inside the repository, and a folder reached twice (a symlink loop) is walked
once.  Unreadable folders are skipped with a log line.  ``walk`` is what both the
start-up scan and the watcher's reconcile use to decide whether a path belongs.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import pathspec

from .files import max_size

log = logging.getLogger(__name__)

DEFAULT_EXCLUDED_DIRS = frozenset({
    ".git", ".hg", ".svn", ".jj", "node_modules", "__pycache__", ".venv", "venv",
    ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".idea", ".vscode-test",
    "dist", "build", "target", ".eggs", ".gradle", ".next", ".cache", "site-packages",
})
EXCLUDED_SUFFIXES = (".min.js", ".min.css", ".map", ".lock", ".svg", ".csv", ".tsv",
                     ".pyc", ".so", ".o", ".a", ".dll", ".dylib", ".exe", ".bin", ".pt",
                     ".safetensors", ".gguf", ".zip", ".gz", ".tar", ".png", ".jpg", ".jpeg",
                     ".gif", ".pdf", ".ico", ".woff", ".woff2", ".ttf", ".sqlite", ".db")
EXCLUDED_NAMES = frozenset({"package-lock.json", "yarn.lock", "pnpm-lock.yaml", "poetry.lock",
                            "Cargo.lock", "uv.lock", ".DS_Store"})
DEFAULT_MAX_FILE_BYTES = 1_000_000
DEFAULT_MAX_FILES = 100_000
# Kernel and virtual file systems: their "files" are not code, and reading some of them
# blocks (/proc/kmsg waits for the kernel's next message).  A repository at / or one that
# holds such a mount (a container's /proc bound in) must not walk into them.
PSEUDO_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "securityfs", "debugfs",
                       "tracefs", "configfs", "fusectl", "mqueue", "hugetlbfs", "bpf", "pstore", "binfmt_misc",
                       "autofs", "efivarfs", "rpc_pipefs", "nsfs", "selinuxfs"})


def pseudo_mounts(mounts: str = "/proc/self/mounts") -> frozenset[str]:
    """Mount points of kernel and virtual file systems (Linux; empty elsewhere)."""
    try:
        lines = Path(mounts).read_text(errors="replace").splitlines()
    except OSError:
        return frozenset()
    out = set()
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and parts[2] in PSEUDO_FS:
            # the mount table escapes spaces, tabs and backslashes in paths as octal (\040)
            out.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1]))
    return frozenset(out)


@dataclass(frozen=True)
class Entry:
    """A file the index should hold: its repository-relative posix path and stat."""

    path: str
    size: int
    mtime_ns: int


def is_virtualenv(path: Path) -> bool:
    try:  # Path.is_file raises on EACCES (a folder we may list but not search)
        return stat.S_ISREG(os.stat(path / "pyvenv.cfg").st_mode)
    except (OSError, ValueError):
        return False


class Rules:
    """The ignore rules of one repository, cached per folder."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_FILE_BYTES):
        self.root = root
        self.real_root = Path(os.path.realpath(root))
        self.max_bytes = max_bytes
        self._specs: dict[str, pathspec.GitIgnoreSpec | None] = {}
        exclude = root / ".git" / "info" / "exclude"
        self.info_exclude = self._load(exclude)
        # only mounts inside the repository matter (links out of it are never followed), so
        # for a usual repository this is empty and the walk pays nothing per folder
        inside = str(self.real_root).rstrip("/") + "/"
        self.pseudo = frozenset(m for m in pseudo_mounts() if m == str(self.real_root) or m.startswith(inside))

    @staticmethod
    def _load(path: Path) -> pathspec.GitIgnoreSpec | None:
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return None
        lines = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        return pathspec.GitIgnoreSpec.from_lines(lines) if lines else None

    def spec_for(self, folder: str) -> pathspec.GitIgnoreSpec | None:
        """The ``.gitignore`` of a folder ('' is the root), or None."""
        if folder not in self._specs:
            self._specs[folder] = self._load(self.root / folder / ".gitignore")
        return self._specs[folder]

    def forget(self, folder: str) -> None:
        """A ``.gitignore`` changed: read it again next time."""
        self._specs.pop(folder, None)

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether a repository-relative posix path is excluded by name or ignore files."""
        parts = rel.split("/")
        name = parts[-1]
        if is_dir and name in DEFAULT_EXCLUDED_DIRS:
            return True
        if not is_dir and (name in EXCLUDED_NAMES or name.endswith(EXCLUDED_SUFFIXES)):
            return True
        probe = rel + "/" if is_dir else rel
        verdict: bool | None = None
        if self.info_exclude is not None:
            r = self.info_exclude.check_file(probe)
            if r.include is not None:
                verdict = r.include
        # Root first, deepest last: a deeper .gitignore overrides a shallower one.
        for depth in range(len(parts)):
            folder = "/".join(parts[:depth])
            spec = self.spec_for(folder)
            if spec is None:
                continue
            sub = "/".join(parts[depth:]) + ("/" if is_dir else "")
            r = spec.check_file(sub)
            if r.include is not None:
                verdict = r.include
        return bool(verdict)

    def inside(self, path: Path) -> bool:
        """Whether ``path`` resolves inside the repository (symlinks included)."""
        try:
            real = Path(os.path.realpath(path))
        except OSError:
            return False
        return real == self.real_root or self.real_root in real.parents

    def accepts(self, rel: str) -> Entry | None:
        """The entry for ``rel`` if it is a file the index should hold, else None.

        Checks every folder on the way (a path inside an ignored folder is ignored) and
        the file itself; binary content is checked later, when the file is read.
        """
        parts = rel.split("/")
        for i in range(1, len(parts)):
            if self.ignored("/".join(parts[:i]), True):
                return None
        if self.ignored(rel, False):
            return None
        path = self.root / rel
        if self.pseudo and any(str(path).startswith(m.rstrip("/") + "/") for m in self.pseudo):
            return None
        try:
            st = path.stat()  # follows a symlink
            if path.is_symlink() and not self.inside(path):
                return None
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_size(rel, self.max_bytes):
            return None
        return Entry(rel, st.st_size, st.st_mtime_ns)


def walk(rules: Rules, start: str = ""):
    """Yield an ``Entry`` for every file the index should hold (below ``start``, a
    repository-relative folder, when given)."""
    seen: set[tuple[int, int]] = set()
    stack = ["" if start in (".", "./") else start.strip("/")]
    while stack:
        folder = stack.pop()
        path = rules.root / folder if folder else rules.root
        try:
            st = path.stat()
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:  # a symlink loop or a second link to the same folder
            continue
        seen.add(key)
        if folder and is_virtualenv(path):
            continue
        if rules.pseudo and os.path.realpath(path) in rules.pseudo:
            log.info("not indexing %s: a kernel or virtual file system", path)
            continue
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            log.warning("cannot list %s: %s", path, exc.strerror or exc)
            continue
        subdirs = []
        for e in entries:
            rel = f"{folder}/{e.name}" if folder else e.name
            try:
                link = e.is_symlink()
                is_dir = e.is_dir()  # follows symlinks
                if link and not rules.inside(Path(e.path)):
                    continue
                if is_dir:
                    if not rules.ignored(rel, True):
                        subdirs.append(rel)
                    continue
                if not e.is_file() or rules.ignored(rel, False):
                    continue
                st = e.stat()
            except OSError:
                continue
            if st.st_size <= max_size(rel, rules.max_bytes):
                yield Entry(rel, st.st_size, st.st_mtime_ns)
        stack.extend(reversed(subdirs))
