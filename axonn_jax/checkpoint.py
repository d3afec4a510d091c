"""Checkpoints: orbax's standard layout, asynchronous, atomic, per-process shards, any grid.

A checkpoint step holds the items ``params``, ``opt_state`` and ``rng`` in
the layout of orbax's ``StandardCheckpointHandler`` (each leaf one global
logical Zarr array named by its keys, ``_METADATA`` as the tree index), and
``meta`` (JSON: step, ``extra``). Plain orbax reads them without axonn_jax::

    ocp.StandardCheckpointer().restore(f"runs/ckpt/{step}/params", target)

Since values are stored whole, not per grid, :meth:`Checkpointer.restore`
places them onto whatever shardings you give (another grid, another process
count, pipeline stages or not, offloaded or not). Orbax's ``CheckpointManager``
runs the save in a background thread and renames the step's temporary
directory only after every process has finished, so a save killed midway
never shows up as a step and never touches earlier ones. Chunks are CRC-32C
checked; a truncated or corrupted checkpoint raises :class:`CheckpointError`
naming the step and the steps that remain. Metadata is JSON; nothing is
unpickled. Steps written by the previous axonn_jax layout (one ``arrays``
item) are still restored.

Every call is collective: run it on every process of the job.

Example::

    from axonn_jax.checkpoint import Checkpointer

    with Checkpointer("runs/ckpt", max_to_keep=3) as ckpt:   # close() finishes the last save
        ckpt.save(step, params, opt_state, extra={"loader": loader.state()})   # returns at once
        ...
        r = ckpt.restore(params=pm.param_structs, optimizer=optimizer)    # latest step, any grid
    params, opt_state = r.params, r.opt_state
    loader = Loader.from_state(tokens, r.extra["loader"], mesh=pm.mesh)

Leaves held by another process (pipeline stages elsewhere) are ``None`` in
what you save and in the restore targets, and come back as ``None``; processes
may pass different trees (e.g. ``{stage: optimizer state}`` of their own
stages): the checkpoint holds the union, and a path no process holds is saved
empty.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import orbax.checkpoint as ocp
except ImportError as err:  # orbax-checkpoint is an optional dependency
    raise ImportError(
        "axonn_jax.checkpoint needs orbax-checkpoint. Remedy: pip install 'axonn_jax[extras]' "
        "(or pip install orbax-checkpoint)."
    ) from err
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.runtime import checkpoint_legacy, writer_lock
from axonn_jax.runtime.checkpoint_handler import (
    EmptyNode,
    LeafKey,
    StandardTreeHandler,
    StandardTreeRestore,
    allgather_json,
    plan_leaves,
    prepare_shards,
)
from axonn_jax.runtime.shard_store import DamagedArrayError, LeafMeta

_ITEMS = ("params", "opt_state", "rng")
_FORMAT = "axonn_jax.checkpoint/2"
_LEGACY_FORMAT = "axonn_jax.checkpoint/1"
_RNG_KEY = "key"  # the rng item is {"key": rng}: orbax items are trees, not bare arrays


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged (the message names step and remedy)."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` returns."""

    step: int
    params: Any
    opt_state: Any | None
    rng: jax.Array | None
    extra: dict


def _create_directory(directory: Path) -> None:
    """Process 0 creates ``directory``; every process returns once it exists (collective)."""
    made = None
    if jax.process_index() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            made = f"cannot create the checkpoint directory {directory}: {err}"
    made = allgather_json(made)[0]
    if made is not None:
        raise OSError(made)


class Checkpointer:
    """Checkpoints of one training run in ``directory`` (one sub-directory per step).

    Args:
        directory: where the steps live (created if needed).
        max_to_keep: keep this many most recent steps (``None``: all).
        asynchronous: return from :meth:`save` once the shards are copied to
            host memory and write them in a background thread.
        read_only: only list and restore (never writes, deletes or cleans up).
        takeover: replace another writer's lock on ``directory`` (a writer of a
            job that is no longer running on another host; see
            :mod:`~axonn_jax.runtime.writer_lock`).

    One writer per directory: a second live writer is refused. Close the
    writer (``with Checkpointer(...) as ckpt:`` or :meth:`close`) to finish the
    last save; one still open when the script ends is finished then, with a
    warning, and a save that failed makes the process exit with status 1
    after naming the step, never hang.
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int | None = 3,
                 asynchronous: bool = True, read_only: bool = False,
                 takeover: bool = False) -> None:  # fmt: skip
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):  # fmt: skip
            raise ValueError(
                f"max_to_keep must be a positive number of steps or None (keep all), got "
                f"{max_to_keep!r}: {max_to_keep!r} would delete every checkpoint it writes. "
                "Remedy: max_to_keep=1 keeps only the latest step."
            )
        self.directory = Path(directory).absolute()
        self._read_only = read_only
        processes = jax.process_count()
        if processes > 1 and not read_only:
            _create_directory(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=asynchronous,
            cleanup_tmp_directories=not read_only,  # remove what killed saves left behind
            read_only=read_only,
            create=not read_only and processes == 1,
            # orbax's barriers through jax.distributed's coordination service, not an XLA
            # program over every device (a job with process-local CPU collectives has none)
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                active_processes=set(range(processes)) if processes > 1 else None),
        )
        handlers = {item: StandardTreeHandler() for item in _ITEMS}
        handlers["meta"] = ocp.JsonCheckpointHandler()
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )
        self._pending: int | None = None  # the step being saved in the background
        self._lock = None if read_only else self._acquire_lock(takeover)
        if not read_only:
            _WRITERS.add(self)

    def _acquire_lock(self, takeover: bool):
        """Process 0 takes the directory's writer lock; every process learns the outcome."""
        lock, refusal = None, None
        if jax.process_index() == 0:
            mine_but_closed = (writer_lock.held_by_this_process(self.directory)
                               and not any(w.directory == self.directory for w in _WRITERS))  # fmt: skip
            try:
                lock = writer_lock.WriterLock.acquire(self.directory, takeover=takeover or mine_but_closed)
            except writer_lock.WriterLockError as err:
                refusal = str(err)
        refusal = allgather_json(refusal)[0]
        if refusal is not None:
            self._manager.close()
            raise writer_lock.WriterLockError(refusal)
        return lock

    # --- saving -----------------------------------------------------------
    def save(self, step: int, params, opt_state=None, extra: Mapping | None = None, *,
             rng: jax.Array | None = None) -> None:  # fmt: skip
        """Start saving ``step``; returns once this process's shards are on the host.

        ``extra`` is JSON (loader position, config, ...). ``rng`` is a PRNG key.
        Call :meth:`wait` (or the next save/restore, or :meth:`close`) to finish.
        """
        _check_step(step, "save")
        if self._read_only:
            raise ValueError(f"this Checkpointer of {self.directory} is read-only")
        record = {"format": _FORMAT, "step": int(step), "extra": dict(extra or {})}
        try:
            record = json.loads(json.dumps(record))  # exactly what restore will return
        except TypeError as err:
            raise TypeError(
                f"extra must be JSON-serialisable ({err}). Remedy: store numbers, strings, lists "
                "and dicts there (e.g. loader.state()); arrays belong in params/opt_state."
            ) from None
        trees = dict(zip(_ITEMS, (params, opt_state, None if rng is None else {_RNG_KEY: rng})))
        items = {item: _keyed(item, tree) for item, tree in trees.items() if tree is not None}
        _check_not_donated(items)
        self.wait()  # the previous save's error surfaces here, before a new one starts
        plans = plan_leaves(items)  # validates, and agrees across processes, first
        # copied to host before orbax starts the step: a bad leaf fails here, not in its threads
        saved = {item: prepare_shards(plan) for item, plan in plans.items() if plan.leaves}
        args = ocp.args.Composite(**saved, meta=ocp.args.JsonSave(record))
        if int(step) in self.all_steps():
            raise ValueError(
                f"{self.directory} already holds step {step}. Remedy: save under a new step "
                "number (or delete that step's directory first)."
            )
        try:  # force: save every step asked for (orbax would skip steps <= the latest)
            self._manager.save(int(step), args=args, force=True)
        except ocp.checkpoint_manager.StepAlreadyExistsError:  # written by another process meanwhile
            raise ValueError(f"{self.directory} already holds step {step}. Remedy: save under a "
                             "new step number.") from None  # fmt: skip
        except Exception as err:
            raise self._failed(int(step), err) from err
        self._pending = int(step)

    def save_train_state(self, step: int, train_step, params, opt_state, extra: Mapping | None = None,
                         *, rng: jax.Array | None = None) -> None:  # fmt: skip
        """:meth:`save` the state of ``pm.train_step(...)`` in a form any grid and mode restores.

        Stores float32 parameters (the masters where the step keeps them) and
        the optimizer state over the whole model, so :meth:`restore_train_state`
        reads it into a step with another grid, with or without a pipeline,
        offload or another precision. Plain orbax sees ``params`` and
        ``opt_state/inner`` as a single-device Flax/optax run would have them.
        """
        params, opt_state = train_step.checkpoint_state(params, opt_state)
        self.save(step, params, opt_state, extra, rng=rng)

    def restore_train_state(self, train_step, params, opt_state, step: int | None = None) -> Restored:
        """Restore what :meth:`save_train_state` saved into ``train_step``'s layout.

        ``params, opt_state`` come from ``train_step.init(...)`` (they give the
        shardings and memory kinds); the result holds the restored pair.
        """
        params_target, opt_target = train_step.checkpoint_target(params, opt_state)
        restored = self.restore(step, params=params_target, opt_state=opt_target)
        params, opt_state = train_step.from_checkpoint(restored.params, restored.opt_state)
        return dataclasses.replace(restored, params=params, opt_state=opt_state)

    def wait(self) -> None:
        """Block until the pending save (if any) is committed.

        Raises:
            CheckpointError: the save failed (I/O error, disk full); names the
                step and the latest complete one, which is untouched.
        """
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._failed(step, err) from err
        if step is not None:
            _FAILED_SAVES.pop(self.directory, None)  # a later step committed: nothing is lost

    def _failed(self, step: int | None, err: BaseException) -> CheckpointError:
        """Record a failed save (the process will exit 1 rather than hang) and describe it."""
        steps = self.all_steps()
        kept = f"the latest complete step is {steps[-1]}" if steps else "no complete step exists yet"
        message = (f"saving step {step} to {self.directory} failed: {type(err).__name__}: {err}; "
                   f"{kept} (untouched). Remedy: fix the cause (space, permissions) and save "
                   "again; restore() reads the complete steps.")  # fmt: skip
        _FAILED_SAVES[self.directory] = message
        global _THREADS_STUCK
        _THREADS_STUCK = True
        return CheckpointError(message)

    # --- listing ----------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps on disk, oldest first (in-flight or killed saves are not listed)."""
        return sorted(ocp.path.step.checkpoint_steps(self.directory))

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # --- restoring --------------------------------------------------------
    def restore(self, step: int | None = None, *, params, opt_state=None,
                optimizer: optax.GradientTransformation | None = None) -> Restored:  # fmt: skip
        """Read ``step`` (default: the latest) onto the given shardings.

        Args:
            params: target pytree matching the saved params; each leaf a
                ``jax.ShapeDtypeStruct`` with a sharding (``pm.param_structs``:
                shape and dtype are checked), a ``jax.Array`` (likewise), a bare
                ``Sharding`` (``pm.param_shardings``: only the layout is checked),
                or ``None`` for a leaf not on this process.
            opt_state: target for the optimizer state, like ``params``; or
            optimizer: derive the optimizer-state target from ``params``: state
                leaves that mirror a parameter take its sharding (and memory
                kind), the rest (step counts) are replicated on the first
                parameter's mesh.
        Raises:
            CheckpointError: no such committed step, or the step is damaged.
            ValueError: the target does not match what was saved (names the path).
        """
        if step is not None:
            _check_step(step, "restore")
        self.wait()
        self._manager.reload()  # steps written by other Checkpointers since this one opened
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoints in {self.directory}. Remedy: check the path")
            step = steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"{self.directory} has no complete checkpoint for step {step} (an interrupted save "
                f"never becomes a step). Remedy: restore one of the complete steps {steps}."
            )
        where = f"checkpoint {self.directory} step {step}"
        try:
            args = ocp.args.Composite(meta=ocp.args.JsonRestore())
            record = self._manager.restore(step, args=args)["meta"]
            if not isinstance(record, dict) or record.get("format") not in (_FORMAT, _LEGACY_FORMAT):
                raise ValueError(f"not a {_FORMAT} record")
        except (OSError, ValueError, KeyError, TypeError) as err:
            err = f"its JSON record 'meta' is unreadable ({err})"
            raise self._damaged(where, step, steps, err) from None
        legacy = record["format"] == _LEGACY_FORMAT
        try:
            saved = self._saved_leaves(step, legacy)
        except (DamagedArrayError, OSError, ValueError, KeyError, TypeError) as err:
            raise self._damaged(where, step, steps, err) from None

        param_targets, param_tree = _targets("params", params, saved, where)
        opt_targets = opt_tree = None
        if opt_state is not None:
            opt_targets, opt_tree = _targets("opt_state", opt_state, saved, where)
        elif optimizer is not None:
            derived = _optimizer_target(optimizer, param_targets, param_tree, saved)
            opt_targets, opt_tree = _targets("opt_state", derived, saved, where)
        _check_complete({"params": param_targets, "opt_state": opt_targets}, saved, where)
        wanted = {**param_targets, **(opt_targets or {})}
        rng_path = "rng" if legacy else f"rng/{_RNG_KEY}"
        if saved.get(rng_path) is not None:
            wanted[rng_path] = None
        reads = {p: t for p, t in wanted.items() if t is not _ELSEWHERE}
        try:
            values = self._read(step, reads, legacy)
        except (DamagedArrayError, OSError) as err:
            raise self._damaged(where, step, steps, err) from None

        def rebuild(targets, tree):
            return jax.tree.unflatten(tree, [values.get(p) for p in targets])

        return Restored(
            step=step,
            params=rebuild(param_targets, param_tree),
            opt_state=None if opt_targets is None else rebuild(opt_targets, opt_tree),
            rng=values.get(rng_path),
            extra=record["extra"],
        )

    def _saved_leaves(self, step: int, legacy: bool) -> dict[str, LeafMeta | None]:
        """``{path: LeafMeta or None (saved empty)}`` of every item of ``step`` (JSON only)."""
        if legacy:
            return checkpoint_legacy.leaf_metadata(self._item_dir(step, checkpoint_legacy.ITEM))
        saved = {}
        for item in _ITEMS:
            directory = self._item_dir(step, item)
            if directory.exists():
                metas = StandardTreeHandler().metadata(directory)
                saved.update({f"{item}/{path}": meta for path, meta in metas.items()})
        return saved

    def _read(self, step: int, reads: Mapping[str, Any], legacy: bool) -> dict[str, Any]:
        """``{path: value}`` of the ``reads`` (``{path: sharding or None}``)."""
        if legacy:
            return checkpoint_legacy.read(self._item_dir(step, checkpoint_legacy.ITEM), reads)
        per_item = {}
        for path, target in reads.items():
            item, _, rest = path.partition("/")
            per_item.setdefault(item, {})[rest] = target
        args = ocp.args.Composite(**{item: StandardTreeRestore(targets)
                                     for item, targets in per_item.items()})  # fmt: skip
        restored = self._manager.restore(step, args=args)
        return {f"{item}/{path}": value for item in per_item for path, value in restored[item].items()}

    def _item_dir(self, step: int, item: str) -> Path:
        return self.directory / str(step) / item

    def _damaged(self, where: str, step: int, steps: list[int], err) -> CheckpointError:
        earlier = [s for s in steps if s < step]
        remedy = (f"restore an earlier step (restore(step={earlier[-1]}); complete steps: {steps})"
                  if earlier else "no earlier step is available; re-initialise")  # fmt: skip
        return CheckpointError(f"{where} is damaged or incomplete: {err}. Remedy: {remedy}.")

    # --- lifetime ---------------------------------------------------------
    def close(self) -> None:
        """Finish the pending save, release orbax's threads and the writer lock.

        Raises :class:`CheckpointError` if that save failed (after releasing)."""
        _WRITERS.discard(self)
        try:
            self.wait()
        finally:
            with contextlib.suppress(Exception):  # a failed save's error was raised by wait
                self._manager.close()
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- the end of the process ------------------------------------------------------
_WRITERS: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_FAILED_SAVES: dict[Path, str] = {}  # per directory, a failed save no later step made good
_THREADS_STUCK = False  # orbax's threads of a failed save never end


def _finish_at_exit() -> None:
    """Commit saves still pending when the script ends (warning), or exit 1 if one failed.

    Runs when the interpreter starts shutting down, before it joins threads.
    Orbax's threads of a failed save wait forever for a signal, so after a
    failed save the process leaves with ``os._exit``: status 1 naming the lost
    step, or 0 if a later save to that directory committed.
    """
    for ckpt in list(_WRITERS):
        step = ckpt._pending
        try:
            ckpt.close()
        except CheckpointError:
            continue  # recorded in _FAILED_SAVES
        if step is not None:
            print(f"axonn_jax.checkpoint: the script ended with the save of step {step} to "
                  f"{ckpt.directory} pending; it is now complete. Remedy: close the Checkpointer "
                  "(or use `with Checkpointer(...)`) so that saves finish where you expect.",
                  file=sys.stderr, flush=True)  # fmt: skip
    if _FAILED_SAVES:
        print("axonn_jax.checkpoint: exiting with status 1 because a save failed:\n  "
              + "\n  ".join(_FAILED_SAVES.values()), file=sys.stderr, flush=True)  # fmt: skip
    if _THREADS_STUCK:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if _FAILED_SAVES else 0)


# before concurrent.futures refuses new work and before threads are joined
getattr(threading, "_register_atexit", __import__("atexit").register)(_finish_at_exit)


# --- module-level conveniences -------------------------------------------------
_OPEN: dict[Path, Checkpointer] = {}


def save(directory: str | Path, step: int, params, opt_state=None, extra: Mapping | None = None,
         *, rng: jax.Array | None = None, max_to_keep: int | None = 3) -> Checkpointer:  # fmt: skip
    """Asynchronous :meth:`Checkpointer.save` into ``directory``; :func:`wait` finishes it."""
    path = Path(directory).absolute()
    if path not in _OPEN:
        _OPEN[path] = Checkpointer(path, max_to_keep=max_to_keep)
    _OPEN[path].save(step, params, opt_state, extra, rng=rng)
    return _OPEN[path]


def wait(directory: str | Path | None = None) -> None:
    """Finish the pending saves (of ``directory``, or of every directory)."""
    paths = list(_OPEN) if directory is None else [Path(directory).absolute()]
    for path in paths:
        if path in _OPEN:
            _OPEN[path].wait()


def close(directory: str | Path | None = None) -> None:
    """Finish and release the checkpointers opened by :func:`save` (of ``directory``, or all)."""
    paths = list(_OPEN) if directory is None else [Path(directory).absolute()]
    for path in paths:
        if path in _OPEN:
            _OPEN.pop(path).close()


def restore(directory: str | Path, step: int | None = None, *, params, opt_state=None,
            optimizer: optax.GradientTransformation | None = None) -> Restored:  # fmt: skip
    """:meth:`Checkpointer.restore` from ``directory`` (after its pending save)."""
    return _reader(directory).restore(step, params=params, opt_state=opt_state, optimizer=optimizer)


def latest_step(directory: str | Path) -> int | None:
    """The newest complete step in ``directory`` (``None`` if there is none)."""
    return _reader(directory).latest_step()


def _reader(directory: str | Path) -> Checkpointer:
    path = Path(directory).absolute()
    if path in _OPEN:
        return _OPEN[path]
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist. Remedy: check the path")
    return Checkpointer(path, read_only=True)


# --- targets -------------------------------------------------------------------
_ELSEWHERE = object()  # a leaf held by another process: not read here


def _is_leaf(x) -> bool:
    return x is None or isinstance(x, (jax.sharding.Sharding, jax.ShapeDtypeStruct))


def _keyed(item: str, tree) -> list[tuple[LeafKey, Any]]:
    """``[(LeafKey, leaf)]`` of ``tree``; ``None`` stays a leaf (held by another process),
    and subtrees without leaves (``{}``, ``optax.EmptyState()``) become :class:`EmptyNode`."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: _is_leaf(x) or _is_empty(x))[0]
    return [(LeafKey.of(keys), _EMPTY_TYPES.get(type(leaf), EmptyNode("None")) if _is_empty(leaf) else leaf)
            for keys, leaf in flat if keys]  # fmt: skip


_EMPTY_TYPES = {dict: EmptyNode("Dict"), list: EmptyNode("List")}


def _is_empty(x) -> bool:
    """A pytree node with no leaves (not ``None``, which marks a leaf held elsewhere)."""
    return (x is not None and not _is_leaf(x) and not jax.tree_util.all_leaves([x])
            and not jax.tree.leaves(x, is_leaf=_is_leaf))  # fmt: skip


def _flatten(item: str, tree) -> tuple[list[tuple[str, Any]], Any]:
    """``[(path, leaf)]`` with paths like ``params/dense/kernel``; ``None`` stays a leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    pairs = []
    for keys, leaf in flat:
        suffix = LeafKey.of(keys).path
        pairs.append((f"{item}/{suffix}" if suffix else item, leaf))
    return pairs, treedef


def _check_not_donated(items: Mapping[str, list]) -> None:
    """Refuse arrays whose buffers a jitted step donated (deleted), naming the first."""
    for item, leaves in items.items():
        for key, leaf in leaves:
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise ValueError(
                    f"checkpoint leaf '{item}/{key.path}' was donated to a jitted step (its buffer "
                    "is deleted). Remedy: save what the step returned "
                    "(params, opt_state, loss = step(params, opt_state, batch); ckpt.save(...))."
                )


def _check_step(step, what: str) -> None:
    """A step is a non-negative ``int`` (not a string, bool or float)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        hint = f" Remedy: {what}(step={int(step)})." if isinstance(step, str) and step.isdigit() else ""
        raise TypeError(f"{what}: step must be a non-negative int, got {step!r} "
                        f"({type(step).__name__}).{hint}")  # fmt: skip
    if step < 0:
        raise ValueError(f"{what}: step must be a non-negative int, got {step}")


def _stored(item: str, saved: Mapping) -> set[str]:
    return {p for p in saved if p == item or p.startswith(item + "/")}


def _mismatch(item: str, where: str, extra, missing) -> ValueError:
    return ValueError(
        f"the {item} target does not match {where}: missing from the checkpoint "
        f"{sorted(extra) or 'none'}; in the checkpoint but not in the target (of any process) "
        f"{sorted(missing) or 'none'}. Remedy: restore with the model"
        f"{' and optimizer' if item == 'opt_state' else ''} the checkpoint was saved with."
    )


def _targets(item: str, tree, saved: Mapping[str, LeafMeta | None], where: str):
    """``({path: sharding | _ELSEWHERE}, treedef)`` for ``tree``, checked against ``saved``.

    Paths are checked here one way (each must be in the checkpoint); that the
    processes' targets together cover the checkpoint is :func:`_check_complete`.
    """
    pairs, treedef = _flatten(item, tree)
    unknown = {p for p, _ in pairs} - _stored(item, saved)
    if unknown:
        raise _mismatch(item, where, unknown, ())
    targets = {}
    for path, leaf in pairs:
        meta = saved[path]
        if leaf is None:
            targets[path] = _ELSEWHERE
            continue
        if meta is None:
            raise ValueError(
                f"'{path}' was saved empty (None on every process) in {where}, but the target "
                "asks for an array. Remedy: pass None for it."
            )
        if isinstance(leaf, jax.sharding.Sharding):
            targets[path] = _checked(leaf, path, meta, where)
            continue
        shape, dtype = tuple(np.shape(leaf)), _dtype_name(leaf)
        if (shape, dtype) != (meta.shape, meta.dtype):
            raise ValueError(
                f"'{path}' is {meta.dtype}{list(meta.shape)} in {where} but the target is "
                f"{dtype}{list(shape)}. Remedy: restore into the model/optimizer configuration it "
                "was saved from (same sizes and dtypes; any grid)."
            )
        sharding = getattr(leaf, "sharding", None)
        if sharding is None and not isinstance(leaf, np.ndarray):
            raise ValueError(f"target '{path}' has no sharding; give a Sharding, jax.Array or "
                             "ShapeDtypeStruct(..., sharding=...)")  # fmt: skip
        targets[path] = None if sharding is None else _checked(sharding, path, meta, where)
    return targets, treedef


def _check_complete(targets: Mapping[str, Mapping | None], saved: Mapping, where: str) -> None:
    """The targets of all processes together cover every saved path with data (collective)."""
    local = {item: sorted(paths) for item, paths in targets.items() if paths is not None}
    union: dict[str, set[str]] = {}
    for listing in allgather_json(local):
        for item, paths in listing.items():
            union.setdefault(item, set()).update(paths)
    for item, paths in union.items():
        missing = {p for p in _stored(item, saved) if saved[p] is not None} - paths
        if missing:
            raise _mismatch(item, where, (), missing)


def _checked(sharding: jax.sharding.Sharding, path: str, meta: LeafMeta, where: str):
    """``sharding`` if it can lay out the saved shape, else a ``ValueError`` naming ``path``."""
    try:
        sharding.shard_shape(meta.shape)
    except ValueError as err:
        raise ValueError(
            f"target sharding of '{path}' cannot lay out its saved shape {list(meta.shape)} "
            f"({where}): {err}. Remedy: pick grid sizes that divide the dimensions."
        ) from None
    return sharding


def _dtype_name(leaf) -> str:
    """The dtype as checkpoints record it (``key<impl>`` for typed PRNG keys)."""
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    if isinstance(leaf, jax.Array) and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return f"key<{jax.random.key_impl(leaf)}>"
    return jnp.dtype(dtype).name


def _optimizer_target(optimizer, param_targets, param_tree, saved):
    """Optimizer-state target: leaves mirroring a parameter take its sharding."""
    from axonn_jax.runtime.offload import optimizer_state_shardings

    shardings = [None if s is _ELSEWHERE else s for s in param_targets.values()]
    meshes = [s.mesh for s in shardings if isinstance(s, NamedSharding)]
    if not meshes:
        raise ValueError(
            "deriving the optimizer-state target needs at least one parameter with a "
            "NamedSharding on this process. Remedy: pass opt_state=... instead."
        )
    abstract = [
        None if s is None else jax.ShapeDtypeStruct(saved[p].shape, jnp.dtype(saved[p].dtype))
        for p, s in zip(param_targets, shardings)
    ]
    params = jax.tree.unflatten(param_tree, abstract)
    return optimizer_state_shardings(optimizer, params, jax.tree.unflatten(param_tree, shardings),
                                     NamedSharding(meshes[0], P()))
