"""HuggingFace GPT-2 round trips shared by ``test_hf.py`` and its mpiexec script.

A random GPT-2 saved with ``save_pretrained`` is the reference; weights are
compared by parameter path, bitwise (loading and exporting do no arithmetic).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import transformers

from axonn_jax.partitioner.trace import path_string

SEQ, VOCAB = 16, 64


def save_gpt2(directory: Path) -> Path:
    """A random 2-block GPT-2 written with save_pretrained (its weights are the reference)."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
    transformers.FlaxGPT2LMHeadModel(config, seed=0).save_pretrained(directory)
    return Path(directory)


def gpt2_batch(batch: int = 8) -> tuple:
    """``(input_ids, attention_mask, position_ids)``: the module's positional inputs."""
    tokens = np.random.default_rng(1).integers(0, VOCAB, (batch, SEQ)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[::2, -3:] = 0  # padding at the end of every other row
    return tokens, mask, np.broadcast_to(np.arange(SEQ, dtype=np.int32), tokens.shape).copy()


def lm_loss(out, batch):
    """Next-token cross-entropy of GPT-2's logits against ``batch[0]``."""
    tokens = batch[0]
    logp = jax.nn.log_softmax(out.logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def saved(directory: Path, cls=None) -> dict:
    """The weights in ``directory`` as transformers reads them, by parameter path."""
    cls = cls or transformers.FlaxGPT2LMHeadModel
    _, weights = cls.from_pretrained(directory, _do_init=False)
    return by_path(weights)


def by_path(tree) -> dict:
    return {path_string(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (sorted(got.keys() ^ want.keys()))
    for path in want:
        assert got[path].dtype == want[path].dtype, (path, got[path].dtype, want[path].dtype)
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def assert_bf16_of_masters(written: dict, device: dict, initial: dict) -> None:
    """The device parameters are the written masters rounded to bf16; the masters carry more."""
    for path, value in written.items():
        assert value.dtype == np.float32, path
        assert device[path].dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(value.astype(jnp.bfloat16), device[path], err_msg=path)
        assert np.any(value != value.astype(jnp.bfloat16).astype(np.float32)), f"{path}: bf16 values"
        assert np.any(value != initial[path]), f"{path} was not trained"
