"""The model's tokenizer as the indexer sees it: batch encoding and a stable id.

Token ids in the datastore are keyed by ``TokenizerInfo.id`` (a hash of the tokenizer's
serialised form), so changing the model re-tokenizes the repository and nothing else.
No torch here: a Hugging Face ``tokenizers.Tokenizer`` or a transformers fast tokenizer
(its ``backend_tokenizer``) is all it needs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


class TokenizerInfo:
    def __init__(self, tokenizer, name: str = ""):
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.backend = backend
        self.name = name
        self.id = hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: Path, name: str = "") -> "TokenizerInfo":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), name or path.parent.name)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        out = self.backend.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in out]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]


def ids_to_blob(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i4").tobytes()


def blob_to_ids(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<i4")
