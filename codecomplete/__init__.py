"""codecomplete: a local daemon that serves inline code completions over LSP.

The subpackages live in the repository's top-level folders (``daemon/``, ``lsp/``,
``indexer/``, ``model/``) and are mapped here by ``pyproject.toml``.
"""

__version__ = "0.1.0"
