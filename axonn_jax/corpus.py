"""Text data available offline (a byte corpus), and the deterministic batches drawn from it.

The default corpus is English prose that every CPython installation ships:
the docstrings of the standard library's pure-Python modules (read from
their source files, never imported). Tokens are bytes (vocabulary 256).

Example:
    >>> tokens = stdlib_corpus(max_bytes=10_000)
    >>> batch = batch_at(tokens, step=0, batch=4, seq=32, seed=0)
    >>> batch.shape
    (4, 33)
"""

from __future__ import annotations

import ast
import sysconfig
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
    text = "\n\n".join(pieces).encode("utf-8", errors="replace")[:max_bytes]
    if len(text) < 10_000:
        raise RuntimeError(
            f"the standard library at {root} yielded only {len(text)} bytes of docstrings; "
            "pass your own corpus (a uint8 array) instead."
        )
    return np.frombuffer(text, dtype=np.uint8).copy()


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
