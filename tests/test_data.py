"""A user's own data: text files, token arrays (.npy, raw .bin memmaps), local tokenizers.

The loader's windows pair with ``next_token_loss``; the example trains on each
kind of file. Exact equality throughout (integer tokens), losses to 1e-6.
"""

import csv
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_flags import codegen_flags

from axonn_jax.corpus import batch_at, load_corpus
from axonn_jax.loader import Loader
from axonn_jax.models import next_token_loss, window_inputs

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--sample-tokens", "4"]
HAS_TOKENIZERS = any(importlib.util.find_spec(m) for m in ("transformers", "tokenizers"))


def example_env() -> dict:
    """The environment of an example process: this one's, with the test processes' code
    generation level (tests/xla_flags.py) as its only XLA flag; the example adds the device
    count its grid needs. (tests/test_example.py's mpiexec and bf16 runs keep XLA's default.)"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if codegen_flags():
        env["XLA_FLAGS"] = codegen_flags()
    return env


def run_example(out: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The example in a fresh process (8 simulated devices); asserts it exits 0."""
    env = example_env()
    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), *args, "--out", str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result


def losses(out: Path) -> list[float]:
    with (out / "metrics.csv").open() as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "notes.txt"
    path.write_text("".join(f"note {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    return path


@pytest.fixture(scope="module")
def token_bin(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    np.random.default_rng(0).integers(0, 3000, size=20_000).astype(np.uint16).tofile(path)
    return path


# --- the corpus and the loader --------------------------------------------------------
def test_text_is_bytes_with_vocab_256(text_file):
    corpus = load_corpus(text_file)
    assert corpus.vocab_size == 256 and corpus.tokens.dtype == np.uint8
    assert corpus.decode(corpus.tokens[:7]) == "note 0:"


def test_token_files_are_memory_mapped(tmp_path, token_bin):
    corpus = load_corpus(token_bin, dtype="uint16")
    expected = np.fromfile(token_bin, np.uint16)
    assert isinstance(corpus.tokens, np.memmap) and corpus.vocab_size == int(expected.max()) + 1
    np.testing.assert_array_equal(corpus.tokens, expected)
    np.save(tmp_path / "tokens.npy", expected.astype(np.uint32))
    npy = load_corpus(tmp_path / "tokens.npy")
    assert isinstance(npy.tokens, np.memmap) and npy.tokens.dtype == np.uint32
    np.testing.assert_array_equal(npy.tokens, expected)
    assert npy.decode([1, 2]) == "1 2"


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "--data-dtype uint16"),
    (dict(dtype="float32"), "expected one of"),
])  # fmt: skip
def test_raw_token_files_need_their_dtype(token_bin, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_corpus(token_bin, **kwargs)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.txt"):
        load_corpus(tmp_path / "nothing.txt")


def test_host_loader_equals_the_reference_batches_and_resumes():
    tokens = np.random.default_rng(1).integers(0, 50, size=1000).astype(np.uint16)
    loader = Loader(tokens, batch=4, seq=8, mesh=None, seed=3)
    first = [next(loader) for _ in range(3)]
    for step, batch in enumerate(first):
        assert isinstance(batch, np.ndarray) and batch.shape == (4, 9)
        np.testing.assert_array_equal(batch, batch_at(tokens, step=step, batch=4, seq=8, seed=3))
    resumed = Loader.from_state(tokens, Loader(tokens, batch=4, seq=8, mesh=None, seed=3,
                                               step=2).state(), mesh=None)  # fmt: skip
    np.testing.assert_array_equal(next(resumed), first[2])


def test_windows_pair_with_next_token_loss():
    """A [B, S + 1] window: all S logits (of window[:, :-1]) predict window[:, 1:]. A [B, S] input:
    the first S - 1 logits predict tokens[:, 1:]."""
    window = jax.random.randint(jax.random.key(0), (2, 9), 0, 11)
    logits = jax.random.normal(jax.random.key(1), (2, 8, 11))
    (inputs,) = window_inputs(window)
    np.testing.assert_array_equal(inputs, window[:, :-1])

    def reference(logits, targets):
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)
        return -picked.mean()

    np.testing.assert_allclose(next_token_loss(logits, window), reference(logits, window[:, 1:]),
                               rtol=1e-6)  # fmt: skip
    np.testing.assert_allclose(next_token_loss(logits, inputs),
                               reference(logits[:, :-1], inputs[:, 1:]), rtol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="do not pair"):
        next_token_loss(logits, window[:, :5])


# --- the example on a user's files ------------------------------------------------------
@pytest.mark.slow
def test_example_trains_on_a_text_file(tmp_path, text_file):
    result = run_example(tmp_path, "--data", str(text_file), "--steps", "4", *SMALL)
    assert re.search(rf"^data: Corpus\({re.escape(str(text_file))}: 21,890 tokens, vocab 256\)$",
                     result.stdout, re.M), result.stdout[:2000]  # fmt: skip
    trained = losses(tmp_path)
    assert len(trained) == 4 and trained[-1] < trained[0]


@pytest.mark.slow
def test_example_trains_on_a_uint16_memmap(tmp_path, token_bin):
    result = run_example(tmp_path, "--data", str(token_bin), "--data-dtype", "uint16",
                         "--grid", "z=4,data=2", "--steps", "3", *SMALL)  # fmt: skip
    vocab = int(np.fromfile(token_bin, np.uint16).max()) + 1
    assert f"tokens, vocab {vocab:,})" in result.stdout, result.stdout[:2000]
    assert len(losses(tmp_path)) == 3 and np.isfinite(losses(tmp_path)).all()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TOKENIZERS, reason="needs transformers or tokenizers")
def test_example_with_a_local_tokenizer(tmp_path, text_file):
    directory = _save_tiny_tokenizer(tmp_path / "tokenizer", text_file.read_text())
    corpus = load_corpus(text_file, tokenizer=directory)
    assert corpus.tokens.dtype == np.uint16 and corpus.vocab_size <= 300
    assert corpus.decode(corpus.tokens[:20]).startswith("note 0: the quick")
    result = run_example(tmp_path / "run", "--data", str(text_file), "--tokenizer", str(directory),
                         "--grid", "x=2,z=2,data=2", "--steps", "3", "--plan-table", *SMALL)  # fmt: skip
    assert re.search(rf"embed/embedding +{corpus.vocab_size}×32", result.stdout), result.stdout[:2000]
    assert len(losses(tmp_path / "run")) == 3


def test_a_missing_tokenizer_directory_is_a_clear_error(tmp_path, text_file):
    if not HAS_TOKENIZERS:
        with pytest.raises(ImportError, match="pip install tokenizers"):
            load_corpus(text_file, tokenizer=tmp_path)
        return
    with pytest.raises(ValueError, match="nothing is downloaded|tokenizer.json"):
        load_corpus(text_file, tokenizer=tmp_path / "absent")


def _save_tiny_tokenizer(directory: Path, text: str) -> Path:
    """A 300-token byte-level BPE trained on ``text``, saved locally (no downloads)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=alphabet))  # fmt: skip
    directory.mkdir(parents=True)
    if importlib.util.find_spec("transformers"):
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(directory))
    else:
        tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.skipif(not HAS_TOKENIZERS, reason="needs transformers or tokenizers")
@pytest.mark.parametrize("given", ["directory", "file"])
def test_a_bare_tokenizer_json_is_read(tmp_path, text_file, given):
    """What ``tokenizers.Tokenizer.save`` writes, alone in a directory or named as a file."""
    tokenizers = pytest.importorskip("tokenizers")
    saved = _save_tiny_tokenizer(tmp_path / "full", text_file.read_text())
    raw = tokenizers.Tokenizer.from_file(str(saved / "tokenizer.json"))
    (tmp_path / "bare").mkdir()
    raw.save(str(tmp_path / "bare" / "tokenizer.json"))
    path = tmp_path / "bare" if given == "directory" else tmp_path / "bare" / "tokenizer.json"
    corpus = load_corpus(text_file, tokenizer=path)
    assert corpus.decode(corpus.tokens[:20]).startswith("note 0: the quick")
    assert corpus.vocab_size == raw.get_vocab_size(with_added_tokens=True)


@pytest.mark.skipif(not importlib.util.find_spec("transformers"), reason="needs transformers")
def test_a_directory_without_a_tokenizer_names_what_it_holds(tmp_path, text_file):
    (tmp_path / "notes.md").write_text("not a tokenizer")
    with pytest.raises(ValueError) as err:
        load_corpus(text_file, tokenizer=tmp_path)
    assert "holds no tokenizer that transformers can read (it holds notes.md" in str(err.value)
    assert "no tokenizer at" not in str(err.value) and "tokenizers.Tokenizer.save" in str(err.value)
