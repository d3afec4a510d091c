"""Token corpora (a user's file or an offline default), and the deterministic batches drawn from them.

:func:`load_corpus` reads a text file as bytes (vocabulary 256) or through a
tokenizer (:mod:`axonn_jax.tokenizer`), or token ids saved as ``.npy`` or as a
raw ``.bin`` array (memory-mapped: only the windows a step needs are read).
The default corpus is English prose that every CPython installation ships:
the docstrings of the standard library's pure-Python modules (read from
their source files, never imported).

Example:
    >>> tokens = stdlib_corpus(max_bytes=10_000)
    >>> batch = batch_at(tokens, step=0, batch=4, seq=32, seed=0)
    >>> batch.shape
    (4, 33)
"""

from __future__ import annotations

import ast
import dataclasses
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

_MODULES = (
    "argparse", "collections/__init__", "contextlib", "csv", "dataclasses", "difflib",
    "functools", "heapq", "inspect", "logging/__init__", "pathlib", "pickle", "random",
    "shutil", "statistics", "string", "subprocess", "tempfile", "textwrap", "threading",
    "typing", "unittest/case", "urllib/parse", "zipfile",
)  # fmt: skip


def stdlib_corpus(max_bytes: int = 2_000_000) -> np.ndarray:
    """Docstrings of standard-library modules as a uint8 token array."""
    text = stdlib_text().encode("utf-8", errors="replace")[:max_bytes]
    return np.frombuffer(text, dtype=np.uint8).copy()


def stdlib_text() -> str:
    """Docstrings of standard-library modules, joined by blank lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces: list[str] = []
    for name in _MODULES:
        path = root / f"{name}.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    pieces.append(doc.strip())
    text = "\n\n".join(pieces)
    if len(text) < 10_000:
        raise RuntimeError(
            f"the standard library at {root} yielded only {len(text)} characters of docstrings; "
            "pass your own corpus (--data PATH, or a token array) instead."
        )
    return text


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token ids (a 1-D integer array, possibly memory-mapped) and how to read them back."""

    tokens: np.ndarray
    vocab_size: int
    decode: Callable[[Sequence[int]], str]
    source: str

    def __repr__(self) -> str:
        return f"Corpus({self.source}: {len(self.tokens):,} tokens, vocab {self.vocab_size:,})"


TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}


def load_corpus(path: str | Path | None = None, *, dtype: str | None = None,
                tokenizer: str | Path | None = None) -> Corpus:  # fmt: skip
    """The corpus in ``path``, by its suffix; the standard-library docstrings if ``None``.

    * ``.npy``: a 1-D integer array (memory-mapped);
    * ``.bin``: raw token ids of ``dtype`` (``uint16``, ``uint32``, ...; memory-mapped);
    * anything else: UTF-8 text, as bytes (vocabulary 256) or encoded by
      ``tokenizer`` (:func:`axonn_jax.tokenizer.load_tokenizer`: a local directory).

    The vocabulary size is the tokenizer's, 256 for bytes, and otherwise the
    largest id + 1. Ids outside the vocabulary raise.
    """
    tok = None
    if tokenizer is not None:
        from axonn_jax.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
    if path is None:
        source = "standard-library docstrings"
        tokens = stdlib_corpus() if tok is None else tok.encode(stdlib_text())
    else:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise FileNotFoundError(f"--data {path}: no such file")
        if path.suffix in (".npy", ".bin"):
            tokens = _token_file(path, dtype)
        elif dtype is not None:
            raise ValueError(f"a dtype ({dtype}) applies to .bin and .npy token files, not to text {path}")
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            tokens = np.frombuffer(text.encode("utf-8"), np.uint8).copy() if tok is None \
                else tok.encode(text)  # fmt: skip
    if tok is not None:
        vocab, decode = tok.vocab_size, tok.decode
    elif tokens.dtype == np.uint8 and (path is None or path.suffix not in (".npy", ".bin")):
        vocab, decode = 256, _decode_bytes
    else:
        vocab, decode = int(tokens.max()) + 1 if len(tokens) else 1, _decode_ids
    if len(tokens) and int(tokens.max()) >= vocab:
        raise ValueError(
            f"{source} holds token id {int(tokens.max())}, outside the vocabulary of {vocab} "
            f"(tokenizer {tokenizer}). Remedy: the tokenizer the ids were made with."
        )
    return Corpus(tokens, vocab, decode, source)


def _token_file(path: Path, dtype: str | None) -> np.ndarray:
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        if dtype is not None and np.dtype(TOKEN_DTYPES.get(dtype, dtype)) != tokens.dtype:
            raise ValueError(f"{path} holds {tokens.dtype}, not {dtype}")
    else:
        if dtype is None:
            raise ValueError(
                f"{path} is a raw token file: its dtype is not stored in it. Remedy: name it, "
                f"e.g. load_corpus(path, dtype='uint16') (the example's --data-dtype uint16; one of "
                f"{', '.join(TOKEN_DTYPES)})."
            )
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"token dtype {dtype!r}: expected one of {', '.join(TOKEN_DTYPES)}")
        size = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        if path.stat().st_size % size:
            raise ValueError(f"{path} has {path.stat().st_size} bytes, not a whole number of {dtype}")
        tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D integer array, got {tokens.dtype}{list(tokens.shape)}")
    return tokens


def _decode_bytes(ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _decode_ids(ids: Sequence[int]) -> str:
    return " ".join(str(int(i)) for i in ids)


def batch_at(tokens: np.ndarray, *, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """The global batch of ``step``: ``batch`` windows of ``seq + 1`` tokens.

    A pure function of ``(seed, step)``, so resuming at step N gives exactly the
    batches an uninterrupted run would have seen.
    """
    starts = window_starts(len(tokens), step=step, batch=batch, seq=seq, seed=seed)
    return np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int32)


def window_starts(num_tokens: int, *, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """Start offsets of the ``batch`` windows of :func:`batch_at` (cheap: no tokens read)."""
    if num_tokens < seq + 2:
        raise ValueError(
            f"a corpus of {num_tokens} tokens is too short for windows of seq + 1 = {seq + 1} "
            "tokens. Remedy: use a longer corpus or a shorter seq."
        )
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, num_tokens - seq - 1, size=batch)


def split(tokens: np.ndarray, *, holdout: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) split at a fixed fraction from the end."""
    cut = int(len(tokens) * (1 - holdout))
    return tokens[:cut], tokens[cut:]
