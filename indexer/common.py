"""The common-code datastore: a suffix array over a general corpus, memory-mapped.

REST's second source: code that is common everywhere (idioms of the language and its
standard library).  The corpus is the running Python's standard library (PSF License
2.0, permissive; present on every machine the daemon runs on) without its tests, codec
tables and demos.  It is built once per tokenizer, offline (never on the completion
path: ``codecomplete-daemon index --common``, or by the daemon in the background the
first time), into the cache directory beside the converted default model, with a
manifest of its sources and their licence, and memory-mapped at start-up.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sysconfig
import time
from pathlib import Path

from .files import SourceError, read_source
from .suffix import Segment, width_for
from .tokens import TokenizerInfo

log = logging.getLogger(__name__)

EXCLUDED = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "encodings", "pydoc_data",
            "ensurepip", "site-packages", "dist-packages", "__pycache__", "config-3"}
MAX_FILE_BYTES = 200_000
PIECE = 64  # files tokenized between two pauses (build_common's pause)


def cache_root() -> Path:
    from codecomplete.paths import cache_dir

    return cache_dir()


def common_dir(tokenizer: TokenizerInfo) -> Path:
    return cache_root() / "common" / tokenizer.id


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED and not d.startswith("config-"))
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return out


def build_common(tokenizer: TokenizerInfo, folder: Path, sources: list[Path] | None = None,
                 licence: str = "PSF-2.0 (Python standard library)", pause=None) -> dict:
    """Tokenize ``sources`` (default: the standard library) into a saved segment.  ``pause``
    (or None): called between pieces of the tokenizing (the index yields to completions there)."""
    t0 = time.perf_counter()
    files = sources if sources is not None else stdlib_sources()
    texts, names = [], []
    for path in files:
        try:
            texts.append(read_source(path, MAX_FILE_BYTES))
            names.append(str(path))
        except SourceError:
            continue
    ids = []
    for i in range(0, len(texts), PIECE):  # the same ids: each text is encoded on its own
        if pause is not None and i:
            pause()
        ids.extend(tokenizer.encode_batch(texts[i:i + PIECE]))
    if pause is not None:
        pause()
    seg = Segment.build(list(zip(names, ids)), width_for(tokenizer.vocab_size))
    save_common(seg, folder, {"tokenizer": tokenizer.id, "tokenizer_name": tokenizer.name, "licence": licence,
                              "built_at": time.time(), "seconds": round(time.perf_counter() - t0, 2),
                              "sources": "python stdlib" if sources is None else "given files"})
    log.info("common datastore: %d files, %d tokens in %.1f s -> %s", len(names), seg.tokens,
             time.perf_counter() - t0, folder)
    return json.loads((folder / "meta.json").read_text())


def save_common(seg: Segment, folder: Path, meta: dict) -> None:
    """``seg`` saved as the datastore in ``folder`` (replacing one there), written beside it first
    so that a reader never sees half of it; ``meta`` must name its tokenizer (``load_common``)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    seg.save(tmp, meta)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_common(tokenizer: TokenizerInfo, folder: Path | None = None) -> Segment | None:
    """The memory-mapped datastore for this tokenizer, or None if not built (or broken)."""
    folder = folder or common_dir(tokenizer)
    if not (folder / "meta.json").is_file():
        return None
    try:
        seg, meta = Segment.load(folder)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("common datastore %s unusable (%s); rebuild with `index --common`", folder, exc)
        return None
    if meta.get("tokenizer") != tokenizer.id:
        log.warning("common datastore %s is for another tokenizer", folder)
        return None
    return seg
