"""Tokenizers from a local directory, through ``transformers`` or ``tokenizers`` when installed.

Nothing is downloaded: ``name_or_path`` is a directory written by
``save_pretrained`` (or holding a ``tokenizer.json``), or, with
``transformers``, a name already in its local cache.

Example::

    tok = load_tokenizer("my-tokenizer/")       # e.g. AutoTokenizer(...).save_pretrained(...)
    ids = tok.encode("hello world")             # np.ndarray, uint16 or uint32
    text = tok.decode(ids)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text ↔ token ids; ``vocab_size`` counts added tokens too."""

    name: str
    vocab_size: int
    _encode: Callable[[str], list[int]]
    _decode: Callable[[list[int]], str]

    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text`` (no special tokens added), uint16 or uint32 by vocabulary size."""
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        return np.asarray(self._encode(text), dtype=dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids])


def load_tokenizer(name_or_path: str | Path) -> Tokenizer:
    """The tokenizer saved at ``name_or_path`` (local files only).

    A ``tokenizer.json`` alone (what ``tokenizers.Tokenizer.save`` writes, as a
    file or in a directory without ``tokenizer_config.json``) is read with
    ``tokenizers``; a ``save_pretrained`` directory or a cached name with
    ``transformers`` (``tokenizers`` when ``transformers`` is missing).
    """
    name = str(name_or_path)
    path = Path(name)
    if path.is_file() or (path.is_dir() and (path / "tokenizer.json").is_file()
                          and not (path / "tokenizer_config.json").is_file()):  # fmt: skip
        return _from_tokenizers(name)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return _from_tokenizers(name)
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(_not_found(path, exc)) from exc
    return Tokenizer(name, len(tok),
                     lambda text: tok.encode(text, add_special_tokens=False, verbose=False),
                     lambda ids: tok.decode(ids))  # fmt: skip


def _not_found(path: Path, exc: Exception) -> str:
    """Why no tokenizer could be read at ``path``, and the remedy."""
    remedy = ("Remedy: a directory written by tokenizer.save_pretrained(...), or a tokenizer.json "
              "(tokenizers.Tokenizer.save); nothing is downloaded.")  # fmt: skip
    if path.is_dir():
        files = sorted(p.name for p in path.iterdir())[:8] or ["nothing"]
        return (f"{str(path)!r} holds no tokenizer that transformers can read (it holds "
                f"{', '.join(files)}; transformers: {type(exc).__name__}: {str(exc)[:200]}). {remedy}")
    return f"no tokenizer at {str(path)!r}: no such directory or file, and no cached name. {remedy}"


def _from_tokenizers(name: str) -> Tokenizer:
    try:
        from tokenizers import Tokenizer as RawTokenizer
    except ImportError:
        raise ImportError(
            f"--tokenizer {name} needs the 'transformers' or the 'tokenizers' package, and neither "
            "is installed. Remedy: pip install tokenizers (or pre-tokenize the data into a .npy "
            "or .bin token file)."
        ) from None
    path = Path(name)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"no tokenizer.json at {name!r}. Remedy: a directory holding tokenizer.json, "
                         "or the path of a tokenizer.json.")  # fmt: skip
    tok = RawTokenizer.from_file(str(path))
    return Tokenizer(name, tok.get_vocab_size(with_added_tokens=True),
                     lambda text: tok.encode(text, add_special_tokens=False).ids,
                     lambda ids: tok.decode(ids))  # fmt: skip
