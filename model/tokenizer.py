"""A checkpoint's tokenizer through the ``tokenizers`` library alone.

Hugging Face's ``AutoTokenizer`` wraps the same ``tokenizers.Tokenizer`` that tokenizer.json
describes, but importing transformers and building its wrapper took 1.1-1.9 s and ~100 MB of a
daemon's start (bench/results/memory_avx512.md), while the file alone reads in 0.08 s.
``FastTokenizer`` gives the part of the Hugging Face API that serving uses (``encode``,
``decode``, ``batch_decode``, ``get_vocab``, ``convert_tokens_to_ids``, the special tokens'
ids, ``len``, ``backend_tokenizer``) on that object, for the tokenizer classes that add nothing
of their own to the file (``GENERIC``); ``load`` returns None for any other, and the loader takes
``AutoTokenizer`` then.  tests/test_loader.py checks it against ``AutoTokenizer`` token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

# tokenizer_config.json classes that are tokenizer.json as it stands (byte-level BPE files and
# the like); SentencePiece-derived classes (Llama's, with legacy prefix-space rules) are not
GENERIC = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2TokenizerFast"})
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class FastTokenizer:
    """The Hugging Face tokenizer API that serving uses, on a ``tokenizers.Tokenizer``."""

    def __init__(self, backend, config: dict):
        self.backend_tokenizer = backend
        self.clean_up_tokenization_spaces = False  # ``load`` declines configs that ask for it
        names = []
        for key in SPECIAL_KEYS:
            token = _content(config.get(key))
            setattr(self, key, token)
            setattr(self, f"{key}_id", backend.token_to_id(token) if token is not None else None)
            names.append(token)
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        names += [_content(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
        ids = (backend.token_to_id(t) for t in names if t is not None)
        self.all_special_ids = sorted({i for i in ids if i is not None})

    @classmethod
    def load(cls, path) -> "FastTokenizer | None":
        """The tokenizer of checkpoint folder ``path``, or None where this class does not give
        what ``AutoTokenizer`` would: no tokenizer.json, another tokenizer class, BOS/EOS added
        by the class, clean-up of spaces, special tokens the file lacks, added tokens the config
        describes otherwise than the file."""
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            if not (path / "tokenizer.json").is_file():
                return None
        except (OSError, ValueError):
            return None
        if (not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC
                or config.get("add_bos_token") or config.get("add_eos_token")
                or config.get("clean_up_tokenization_spaces") or config.get("add_prefix_space") is not None):
            return None
        try:
            backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception:  # noqa: BLE001 - a file the library cannot read: AutoTokenizer says why
            return None
        tok = cls(backend, config)
        wanted = [t for t in (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) if t is not None]
        if any(backend.token_to_id(t) is None for t in wanted):
            return None  # Hugging Face would add them to the vocabulary
        # added tokens the config describes otherwise than the file (another id, another special
        # flag): Hugging Face would follow the config
        ours = backend.get_added_tokens_decoder()
        for i, added in (config.get("added_tokens_decoder") or {}).items():
            mine = ours.get(int(i))
            if mine is None or mine.content != _content(added) or mine.special != bool(added.get("special")):
                return None
        return tok

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.decode_batch([list(s) for s in sequences],
                                                   skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            got = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if got is None else got
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]
