"""A deterministic, resumable loader that gives every process its shard of the batch.

The global batch of step ``n`` is :func:`axonn_jax.corpus.batch_at` (a pure
function of ``(seed, n)``): ``batch`` windows of ``seq + 1`` tokens, the
model's inputs ``window[:, :-1]`` and the next tokens they predict. It is laid
out for a stage mesh ``(data, z, y, x)``: the batch dim is split over
``(data, z)`` and replicated over ``x`` and ``y``, the layout ``pm.apply``
expects. The array is built with ``jax.make_array_from_callback``, so each
process reads only the token windows of its own devices (the window offsets
of the whole batch are a few integers). With ``mesh=None`` (pipelines: the
runtime places each microbatch on its stages) a step is a host array.

The windows pair with :func:`axonn_jax.models.next_token_loss`, which takes a
``[B, S + 1]`` window beside ``[B, S, vocab]`` logits.

Example::

    from axonn_jax.models import next_token_loss, window_inputs

    loader = Loader(tokens, batch=16, seq=64, mesh=pm.mesh, seed=0)
    batch = next(loader)                   # [16, 65] int32, rows split over (data, z)
    loss = next_token_loss(pm.apply(params, batch[:, :-1]), batch)
    step = pm.train_step(next_token_loss, optax.adamw(1e-3), inputs=window_inputs)  # the same
    state = loader.state()                 # {'step': 1, 'seed': 0, ...}: save it with a checkpoint
    loader = Loader.from_state(tokens, state, mesh=pm.mesh)   # ... and resume exactly
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.corpus import batch_at, window_starts
from axonn_jax.partitioner.grid import BATCH_AXES

_STATE_KEYS = ("step", "seed", "batch", "seq", "microbatches", "num_tokens")


class Loader:
    """Global batches of ``seq + 1``-token windows, sharded for ``mesh``.

    Args:
        tokens: the corpus, a 1-D integer array (e.g. :func:`~axonn_jax.corpus.stdlib_corpus`).
        batch: global batch size (sequences per step, all microbatches together).
        seq: sequence length; each row holds ``seq + 1`` tokens (inputs and shifted labels).
        mesh: a stage mesh with axes ``data`` and ``z`` (``pm.mesh`` or
            ``grid.stage_meshes()[s]``); other axes replicate the batch.
            ``None``: host (numpy) arrays of the whole batch, e.g. for
            ``pm.train_step`` on a pipeline grid.
        seed: the data seed; batches are a pure function of ``(seed, step)``.
        microbatches: ``m > 1`` makes each step an ``[m, batch / m, seq + 1]``
            array: microbatch ``i`` is rows ``i·batch/m … (i+1)·batch/m`` of the
            global batch, each split over ``(data, z)``.
        step: the step the next call to ``next()`` returns.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        batch: int,
        seq: int,
        mesh: Mesh | None,
        seed: int = 0,
        microbatches: int = 1,
        step: int = 0,
    ) -> None:
        self.tokens = np.asarray(tokens)
        if self.tokens.ndim != 1 or not np.issubdtype(self.tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, got shape {self.tokens.shape} and dtype "
                f"{self.tokens.dtype}. Remedy: pass e.g. axonn_jax.corpus.stdlib_corpus()."
            )
        for name, value in (("batch", batch), ("seq", seq), ("microbatches", microbatches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        missing = [] if mesh is None else [a for a in BATCH_AXES if a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"mesh axes {mesh.axis_names} lack {missing}: the loader splits the batch over "
                f"{BATCH_AXES}. Remedy: pass a stage mesh (pm.mesh or grid.stage_meshes()[s])."
            )
        sizes = {a: 1 if mesh is None else mesh.shape[a] for a in BATCH_AXES}
        shards = int(np.prod(list(sizes.values())))
        if batch % (microbatches * shards):
            raise ValueError(
                f"batch {batch} is not divisible by microbatches × data × z = {microbatches} × "
                f"{sizes['data']} × {sizes['z']}: each microbatch is split over "
                f"(data, z). Remedy: use a batch that is a multiple of {microbatches * shards}."
            )
        window_starts(len(self.tokens), step=0, batch=1, seq=seq, seed=seed)  # validates seq
        self.batch, self.seq, self.mesh, self.seed = batch, seq, mesh, seed
        self.microbatches, self.step = microbatches, step

    # --- resumption -------------------------------------------------------
    def state(self) -> dict[str, int]:
        """JSON-able position: store it in the checkpoint's ``extra``."""
        return dict(step=self.step, seed=self.seed, batch=self.batch, seq=self.seq,
                    microbatches=self.microbatches, num_tokens=len(self.tokens))  # fmt: skip

    @classmethod
    def from_state(cls, tokens: np.ndarray, state: Mapping[str, int], *,
                   mesh: Mesh | None) -> Loader:  # fmt: skip
        """Resume from :meth:`state`; the corpus must have the length it had then."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"loader state lacks {missing}; it must come from Loader.state()")
        if len(tokens) != state["num_tokens"]:
            raise ValueError(
                f"the loader state was saved with a corpus of {state['num_tokens']} tokens, but "
                f"this corpus has {len(tokens)}: batches would differ from the original run. "
                "Remedy: resume with the same corpus."
            )
        return cls(tokens, batch=state["batch"], seq=state["seq"], mesh=mesh, seed=state["seed"],
                   microbatches=state["microbatches"], step=state["step"])  # fmt: skip

    # --- batches ----------------------------------------------------------
    def global_batch(self, step: int) -> np.ndarray:
        """The whole batch of ``step`` on the host, ``[batch, seq + 1]`` (a reference)."""
        return batch_at(self.tokens, step=step, batch=self.batch, seq=self.seq, seed=self.seed)

    @property
    def sharding(self) -> NamedSharding | None:
        """Where a step's array lives: batch rows over ``(data, z)`` (``None``: on the host)."""
        if self.mesh is None:
            return None
        spec = P(BATCH_AXES) if self.microbatches == 1 else P(None, BATCH_AXES)
        return NamedSharding(self.mesh, spec)

    @property
    def shape(self) -> tuple[int, ...]:
        """``[batch, seq + 1]``, or ``[m, batch / m, seq + 1]`` with microbatches."""
        rows, m = self.batch, self.microbatches
        return (rows, self.seq + 1) if m == 1 else (m, rows // m, self.seq + 1)

    def at(self, step: int) -> jax.Array | np.ndarray:
        """The sharded array of ``step``; each process reads only its own rows."""
        if self.mesh is None:
            return self.global_batch(step).reshape(self.shape)
        starts = window_starts(len(self.tokens), step=step, batch=self.batch, seq=self.seq,
                               seed=self.seed).reshape(self.shape[:-1])  # fmt: skip
        cache: dict[tuple, np.ndarray] = {}

        def rows(index: tuple[slice, ...]) -> np.ndarray:
            key = tuple((s.start, s.stop) for s in index[:-1])
            if key not in cache:
                picked = starts[index[:-1]]
                windows = self.tokens[picked[..., None] + np.arange(self.seq + 1)]
                cache[key] = windows[(...,) + (index[-1],)].astype(np.int32)
            return cache[key]

        return jax.make_array_from_callback(self.shape, self.sharding, rows, dtype=np.int32)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> jax.Array | np.ndarray:
        out = self.at(self.step)
        self.step += 1
        return out

    def __repr__(self) -> str:
        return (f"Loader(batch={self.batch}, seq={self.seq}, microbatches={self.microbatches}, "
                f"seed={self.seed}, step={self.step}, "
                f"mesh={None if self.mesh is None else dict(self.mesh.shape)})")  # fmt: skip
