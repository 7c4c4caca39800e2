"""Logging for the daemon: stderr or a file, never stdout (stdout is the LSP channel)."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def setup_logging(verbosity: int = 0, log_file: str | None = None, quiet: bool = False) -> None:
    """``verbosity`` 0: info (warning if ``quiet``), 1: debug, 2: debug for pygls too."""
    level = logging.DEBUG if verbosity >= 1 else logging.WARNING if quiet else logging.INFO
    handler: logging.Handler
    if log_file:
        handler = logging.FileHandler(log_file, encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # pygls logs every message it sends at INFO: keep that for -vv.
    logging.getLogger("pygls").setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)
    for noisy in ("transformers", "huggingface_hub", "urllib3", "filelock", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.WARNING if verbosity < 2 else logging.DEBUG)
