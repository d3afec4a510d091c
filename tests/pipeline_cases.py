"""Pipelined runs against the plain single-device Flax/optax computation.

Shared by the in-process tests (``test_pipeline.py``) and the MPI script
(``mpi_scripts/pipeline_equivalence.py``). The microbatch size is fixed, so
every microbatch count reuses the same compiled stage programs; the global
batch is ``microbatches × MB_ROWS`` sequences and the reference is computed on
that whole batch.

Bounds (fp32), the same as the partitioner's equivalence tests:
* loss: |Δ| ≤ 1e-5·|ref|;
* gradients, per leaf held by this process: max|Δ| ≤ 1e-5·max|ref leaf| + 1e-6·G
  (G the largest gradient entry: an absolute floor for leaves whose true
  gradient is 0, such as attention key biases);
* parameters after 5 AdamW steps: ‖Δ‖₂ ≤ 1e-3·‖p_ref − p₀‖₂ per leaf (leaves with a
  zero true gradient: max|Δ| ≤ 2·5·lr, Adam's step bound).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
from partition_cases import adamw_trajectory

import axonn_jax
from axonn_jax.models import GPT, GPTConfig, next_token_loss
from axonn_jax.partitioner.trace import path_string

SEQ, VOCAB, MB_ROWS = 16, 64, 4
LR, STEPS = 1e-2, 5
MICROBATCHES, TRAJECTORY_MICROBATCHES = (1, 4, 8), 4
MODELS = ("gpt", "hf_gpt2", "mlp", "cnn", "encdec", "scan_gpt")


@dataclasses.dataclass
class Case:
    model: object
    inputs: object  # batch → model args
    loss: object  # loss(outputs, batch) → scalar
    batch: object  # microbatches → batch


def _tokens(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(rows, SEQ)).astype(np.int32)


def _regression(rows: int, seed: int = 0, shape=(8,)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, *shape)).astype(np.float32),
            rng.standard_normal((rows, 10)).astype(np.float32))  # fmt: skip


def build(name: str) -> Case:
    """A 4-layer model (so that 4 stages each hold a block); ``mlp``, ``cnn``, ``encdec``: the
    other kinds whose automatic stages used to be 100/0 or refused (issue 26)."""
    if name == "mlp":
        from axonn_jax.models import MLP

        return Case(MLP(features=(32, 32, 32, 32, 10)), lambda b: (b[0],),
                    lambda out, b: jnp.mean((out - b[1]) ** 2),
                    lambda m: _regression(m * MB_ROWS))  # fmt: skip
    if name == "cnn":
        from axonn_jax.models import CNN

        return Case(CNN(channels=(4, 8), num_classes=10), lambda b: (b[0],),
                    lambda out, b: jnp.mean((out - b[1]) ** 2),
                    lambda m: _regression(m * MB_ROWS, shape=(8, 8, 1)))  # fmt: skip
    if name == "encdec":
        from axonn_jax.models import EncDecConfig, EncoderDecoder

        config = EncDecConfig(vocab_size=VOCAB, num_encoder_layers=2, num_decoder_layers=2, hidden=32,
                              num_heads=4, max_seq_len=SEQ)  # fmt: skip
        return Case(EncoderDecoder(config), lambda b: (b[0], b[1][:, :-1]),
                    lambda out, b: next_token_loss(out, b[1]),
                    lambda m: (_tokens(m * MB_ROWS, seed=1), _tokens(m * MB_ROWS, seed=2)))  # fmt: skip
    if name == "gpt":
        config = GPTConfig(vocab_size=VOCAB, num_layers=4, hidden=32, num_heads=4, max_seq_len=SEQ)
        return Case(GPT(config), lambda t: (t,), lambda out, t: next_token_loss(out, t),
                    lambda m: _tokens(m * MB_ROWS))  # fmt: skip
    if name == "scan_gpt":  # the 4 blocks as one nn.scan: each stage is given its layers' rows
        from control_flow_cases import ScanGPT

        return Case(ScanGPT(), lambda t: (t,), lambda out, t: next_token_loss(out, t),
                    lambda m: _tokens(m * MB_ROWS))  # fmt: skip
    if name == "hf_gpt2":  # HuggingFace transformers' Flax GPT-2, unmodified
        import transformers as hf
        from transformers.models.gpt2 import modeling_flax_gpt2 as gpt2

        config = hf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4)

        def batch(m):
            tokens = _tokens(m * MB_ROWS)
            mask = np.ones_like(tokens)
            mask[::2, -3:] = 0  # padded sequences
            positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), tokens.shape).copy()
            return (tokens, mask, positions)

        return Case(gpt2.FlaxGPT2LMHeadModule(config), lambda b: b,
                    lambda out, b: next_token_loss(out.logits, b[0]), batch)  # fmt: skip
    raise KeyError(name)


@dataclasses.dataclass(frozen=True)
class Reference:
    """Plain Flax + optax on one device, as numpy trees."""

    init: dict  # initial parameters
    grads: dict  # gradients at ``init``
    losses: list[float]  # one per step, the first at ``init``
    final: dict  # parameters after ``len(losses)`` AdamW steps


def reference(case: Case, batch, steps: int = STEPS) -> Reference:
    """The plain computation on ``batch``: gradients at init, then ``steps`` AdamW steps."""
    args = case.inputs(batch)
    params = case.model.init(jax.random.key(0), *args)["params"]

    def loss_fn(p):
        return case.loss(case.model.apply({"params": p}, *args), batch)

    losses, first, p = adamw_trajectory(loss_fn, params, steps, LR)
    to_np = lambda t: jax.tree.map(np.asarray, t)  # noqa: E731
    return Reference(to_np(params), to_np(first), losses, to_np(p))


@functools.cache
def _reference(name: str, m: int) -> Reference:
    """The reference of ``m`` microbatches, all ``STEPS`` AdamW steps (once per process)."""
    case = build(name)
    return reference(case, case.batch(m), STEPS)


def references(name: str, microbatches: tuple[int, ...] = MICROBATCHES,
               trajectory_microbatches: int = TRAJECTORY_MICROBATCHES) -> dict[int, Reference]:
    """Per microbatch count, the reference on that batch.

    Each count's reference is computed once per process, with all ``STEPS`` AdamW
    steps (one compiled step; only the trajectory's count compares the steps, the
    others their gradients), so that every table of counts shares them.
    """
    counts = sorted({*microbatches, trajectory_microbatches})
    return {m: _reference(name, m) for m in counts}


def partitioned(name: str, grid: axonn_jax.Grid | str) -> tuple[Case, object]:
    """``(case, pm)``: :func:`build`'s model partitioned on ``grid`` (a Grid or its text), once
    per process (the 8 last ones kept).

    Tests of one model and grid share it, so they share its compiled stage programs (the
    engine caches them per input signature and loss function: the case's loss is one
    object); each test still builds its own steps, parameters and optimizer state.
    """
    return _partitioned(name, axonn_jax.Grid.parse(grid) if isinstance(grid, str) else grid)


@functools.lru_cache(maxsize=8)
def _partitioned(name: str, grid: axonn_jax.Grid) -> tuple[Case, object]:
    case = build(name)
    return case, axonn_jax.partition(case.model, grid, *case.inputs(case.batch(1)))


def save_references(name: str, path: str | os.PathLike) -> None:
    """Write :func:`references` for ``name`` (default counts) to ``path`` for a launched job."""
    with open(path, "wb") as f:
        pickle.dump(references(name), f)


def load_references(path: str | os.PathLike) -> dict[int, Reference]:
    with open(path, "rb") as f:
        return pickle.load(f)


def _leaves(tree) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {path_string(k): v for k, v in flat if v is not None}


def _missing_or_unexpected(got_l: dict, ref_l: dict, what: str, kind: str) -> list[str]:
    """Every reference leaf must be there (``pm.gather`` returns all on every process)."""
    failures = [f"{what} {kind} {path}: missing (None or absent)" for path in ref_l if path not in got_l]
    return failures + [f"{what} {kind} {path}: not in the reference" for path in got_l if path not in ref_l]


def compare_grads(got, ref, what: str) -> list[str]:
    """Every leaf of the reference against ``got``; returns failure messages.

    A leaf that ``got`` lacks (or holds as ``None``) is a failure, not skipped.
    """
    ref_l, got_l = _leaves(ref), _leaves(got)
    scale = max(np.max(np.abs(g)) for g in ref_l.values())
    failures = _missing_or_unexpected(got_l, ref_l, what, "grad")
    for path, r in ref_l.items():
        if path not in got_l:
            continue
        value = got_l[path]
        err = float(np.max(np.abs(np.asarray(value) - r)))
        bound = 1e-5 * np.max(np.abs(r)) + 1e-6 * scale
        if err > bound:
            failures.append(f"{what} grad {path}: {err:.3e} > {bound:.3e}")
    return failures


def compare_params(got, ref, init, ref_grads, what: str) -> list[str]:
    """Every reference parameter after the steps against ``got`` (a missing leaf fails)."""
    ref_l, got_l, init_l, g_l = _leaves(ref), _leaves(got), _leaves(init), _leaves(ref_grads)
    scale = max(np.max(np.abs(g)) for g in g_l.values())
    failures = _missing_or_unexpected(got_l, ref_l, what, "param")
    for path in ref_l:
        if path not in got_l:
            continue
        value = np.asarray(got_l[path])
        if np.max(np.abs(g_l[path])) <= 1e-6 * scale:
            err, bound = float(np.max(np.abs(value - ref_l[path]))), 2 * STEPS * LR
        else:
            err = float(np.linalg.norm(value - ref_l[path]))
            bound = 1e-3 * float(np.linalg.norm(ref_l[path] - init_l[path]))
        if err > bound:
            failures.append(f"{what} param {path} after {STEPS} steps: {err:.3e} > {bound:.3e}")
    return failures


@functools.cache
def with_loss_aux(loss_fn):
    """``loss_fn`` returning ``(loss, {"loss": loss})`` (``has_aux=True``): the aux, computed on
    the last stage, is checked on every rank; one function per loss, so steps share programs."""

    def loss_and_aux(outputs, batch):
        loss = loss_fn(outputs, batch)
        return loss, {"loss": loss}

    return loss_and_aux


def aux_failures(loss, aux, what: str) -> list[str]:
    """The aux's copy of the loss (the mean over microbatches, as the loss) equals the loss."""
    if sorted(aux) != ["loss"] or abs(float(aux["loss"]) - float(loss)) > 1e-6 * abs(float(loss)):
        return [f"{what} aux {aux} does not hold the loss {float(loss)}"]
    return []


def run_case(name: str, grid: axonn_jax.Grid, microbatches=MICROBATCHES,
             schedules=("message",), trajectory_microbatches: int = TRAJECTORY_MICROBATCHES,
             offload: bool = False, refs: dict[int, Reference] | None = None,
             trajectory_schedule: str = "message", update_on: str = "host") -> list[str]:  # fmt: skip
    """Grads for each microbatch count and schedule, then 5 AdamW steps; failure messages.

    ``offload=True`` runs the 5 steps with fp32 master weights and AdamW state in
    host memory (the same arithmetic, so the same bounds), updated where ``update_on``
    says; ``trajectory_schedule`` runs them. ``refs`` (from
    :func:`load_references`) saves recomputing the reference in each process.
    """
    case, pm = partitioned(name, grid)
    refs = refs or references(name, tuple(microbatches), trajectory_microbatches)
    failures: list[str] = []
    for m in microbatches:
        batch, ref = case.batch(m), refs[m]
        params = pm.shard(ref.init)
        for schedule in schedules:
            step = pm.value_and_grad(with_loss_aux(case.loss), inputs=case.inputs, microbatches=m,
                                     schedule=schedule, has_aux=True)  # fmt: skip
            (loss, aux), grads = step(params, batch)
            what = f"{name} {grid} m={m} {schedule}"
            failures += aux_failures(loss, aux, what)
            if abs(float(loss) - ref.losses[0]) > 1e-5 * abs(ref.losses[0]):
                failures.append(f"{what} loss {float(loss)} != {ref.losses[0]}")
            failures += compare_grads(pm.gather(grads), ref.grads, what)
            failures += [f"{what} loss not planned with the last stage: {n}" for n in step.loss_notes.values()]
    m = trajectory_microbatches
    batch, ref = case.batch(m), refs[m]
    step = pm.train_step(with_loss_aux(case.loss), optax.adamw(LR), inputs=case.inputs, microbatches=m,
                         offload=offload, update_on=update_on, schedule=trajectory_schedule, has_aux=True)  # fmt: skip
    params, opt_state = step.init(pm.shard(ref.init))
    losses = []
    what = f"{name} {grid} m={m} AdamW {trajectory_schedule}" + (f" offloaded ({update_on})" if offload else "")
    for _ in range(STEPS):
        params, opt_state, (loss, aux) = step(params, opt_state, batch)
        losses.append(float(loss))
        failures += aux_failures(loss, aux, what)
    if not np.allclose(losses, ref.losses, rtol=1e-5):
        failures.append(f"{what} losses {losses} != {ref.losses}")
    failures += compare_params(pm.gather(params), ref.final, ref.init, ref.grads, what)
    return failures


def assert_compiles_once(case: Case, pm, params, caplog) -> None:
    """A recompilation guard: after a pipelined AdamW step's first call, two more steps
    compile nothing at all, and every local stage program is an AOT ``Compiled``."""
    import logging

    from jax.stages import Compiled

    batch = case.batch(4)
    step = pm.train_step(case.loss, optax.adamw(1e-3), inputs=case.inputs, microbatches=4)
    params = jax.tree.map(lambda x: x.copy(), params)  # the step donates its inputs
    params, opt_state = step.init(params)
    assert sorted(opt_state.optimizer) == list(range(len(pm.plan.stages)))
    params, opt_state, _ = step(params, opt_state, batch)
    programs = step.value_and_grad.stage_programs(case.inputs(case.batch(1)))
    *inner, last = programs
    assert all(isinstance(f, Compiled) for p in inner for f in (p.forward, p.backward))
    assert isinstance(last.forward_backward, Compiled)
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
        for _ in range(2):
            params, opt_state, loss = step(params, opt_state, batch)
        jax.block_until_ready(params)
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert not compiles, compiles
    assert np.isfinite(float(loss))
