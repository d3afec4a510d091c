"""The :class:`Checkpointer`: orbax's standard layout, asynchronous, atomic, per-process shards, any grid.

User documentation: :mod:`axonn_jax.checkpoint`. A step holds the items
``params``, ``opt_state`` and ``rng`` written by
:class:`~axonn_jax.runtime.checkpoint.handler.StandardTreeHandler` and
``meta`` (JSON: format, step, ``extra``); orbax's ``CheckpointManager`` commits
each step atomically and keeps ``max_to_keep`` of them. Restores go through
:mod:`~axonn_jax.runtime.checkpoint.targets`; the writer lock is
:mod:`~axonn_jax.runtime.checkpoint.writer_lock`; what happens at exit is
:mod:`~axonn_jax.runtime.checkpoint.lifetime`.

Example::

    with Checkpointer("runs/ckpt", max_to_keep=3) as ckpt:
        ckpt.save(step, params, opt_state, extra={"loader": loader.state()})
        r = ckpt.restore(params=pm.param_structs, optimizer=optimizer)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import optax
import orbax.checkpoint as ocp

from axonn_jax.runtime.agreement import agree_on_call
from axonn_jax.runtime.collectives import host_comm
from axonn_jax.runtime.checkpoint import lifetime, writer_lock
from axonn_jax.runtime.checkpoint.handler import (StandardTreeHandler, StandardTreeRestore, allgather_json, plan_leaves,
                                                 prepare_shards)
from axonn_jax.runtime.checkpoint.shard_store import DamagedArrayError, LeafMeta
from axonn_jax.runtime.checkpoint.targets import (ELSEWHERE, check_complete, check_not_donated, check_step, keyed,
                                                  optimizer_target, targets)  # fmt: skip

_ITEMS = ("params", "opt_state", "rng")
_FORMAT = "axonn_jax.checkpoint/2"
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
    #: what :meth:`Checkpointer.save_train_state` recorded of the step that saved it
    #: (``{"optimizer": its update's summary}``); empty for :meth:`Checkpointer.save`
    saved_by: dict = dataclasses.field(default_factory=dict)


def _nested(flat: Mapping[str, Any]) -> dict:
    """``{"a/b": v}`` → ``{"a": {"b": v}}``."""
    out: dict = {}
    for path, value in flat.items():
        *parents, last = path.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def foreign_step_folders(directory: Path) -> list[str]:
    """Folders of ``directory`` named like a step (digits: orbax reads ``0042`` as step 42)
    that hold nothing a save writes (no item folder, no orbax step metadata or commit
    marker, as a killed save may leave): the user's own.

    Orbax would list them as steps, and delete them once ``max_to_keep`` newer steps exist.

    Example:
        >>> foreign_step_folders(Path("runs/ckpt"))  # doctest: +SKIP
        ['7']
    """
    if not directory.is_dir():
        return []
    written = (*_ITEMS, "meta", "_CHECKPOINT_METADATA", "commit_success.txt")
    return sorted(d.name for d in directory.iterdir() if d.is_dir() and d.name.isdigit()
                  and not any((d / name).exists() for name in written))  # fmt: skip


def _await_leftover_removal(manager) -> None:
    """Wait until orbax has removed the temporary folders killed saves left.

    Orbax starts that removal in a background thread when a writing manager is made,
    and its ``close`` does not wait for it: a job that copies or deletes the directory
    right after closing could meet a half-removed folder. (A private method of orbax's
    ``CheckpointManager``; without it, nothing to wait for is known.)
    """
    wait = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
    if wait is not None:
        wait()


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
            :mod:`~axonn_jax.runtime.checkpoint.writer_lock`).
        timeout: seconds every process has to make the same call (creating a
            writer, :meth:`save`, :meth:`restore`, :meth:`delete`) under ``mpiexec``; else all raise
            (:mod:`~axonn_jax.runtime.agreement`: ``if rank == 0: save(...)``
            used to hang every process).

    One writer per directory: a second live writer is refused. Close the
    writer (``with Checkpointer(...) as ckpt:`` or :meth:`close`) to finish the
    last save; one still open when the script ends is finished then, with a
    warning, and a save that failed makes the process exit with status 1
    after naming the step, never hang.
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int | None = 3,
                 asynchronous: bool = True, read_only: bool = False,
                 takeover: bool = False, timeout: float = 60.0) -> None:  # fmt: skip
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):  # fmt: skip
            raise ValueError(
                f"max_to_keep must be a positive number of steps or None (keep all), got "
                f"{max_to_keep!r}: {max_to_keep!r} would delete every checkpoint it writes. "
                "Remedy: max_to_keep=1 keeps only the latest step."
            )
        self.directory = Path(directory).absolute()
        self._read_only, self._timeout = read_only, timeout
        if not read_only:  # a writer is collective from here on (a reader lists steps alone)
            self._agree("Checkpointer")
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"the checkpoint directory {self.directory} is a file. Remedy: "
                                     "name a directory (it is created if missing).")
        foreign = foreign_step_folders(self.directory)
        listed = f"{', '.join(foreign[:5])}{' …' if len(foreign) > 5 else ''}"
        if foreign and read_only:  # skipped: the latest step is the latest real one
            warnings.warn(f"{self.directory}: ignoring folders named like steps that hold no checkpoint: "
                          f"{listed}", stacklevel=2)  # fmt: skip
        if foreign and not read_only:
            raise ValueError(
                f"{self.directory} holds folders named like checkpoint steps that are not "
                f"checkpoints: {listed}. Orbax "
                "would count them as steps and delete them when it keeps the newest max_to_keep. "
                "Remedy: move them out, or give the Checkpointer a directory of its own."
            )
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
        self.pending_step: int | None = None  # the step being saved in the background
        self._lock = None
        if not read_only:
            try:
                self._lock = writer_lock.acquire_for_job(self.directory, takeover=takeover,
                                                         writing_here=lifetime.writing_to(self.directory))  # fmt: skip
            except writer_lock.WriterLockError:
                self._manager.close()
                raise
            lifetime.opened(self)

    # --- saving -----------------------------------------------------------
    def save(self, step: int, params, opt_state=None, extra: Mapping | None = None, *,
             rng: jax.Array | None = None, saved_by: Mapping | None = None) -> None:  # fmt: skip
        """Start saving ``step``; returns once this process's shards are on the host.

        ``extra`` is JSON (loader position, config, ...). ``rng`` is a PRNG key.
        ``saved_by``: JSON describing what saved it (``Restored.saved_by``).
        Call :meth:`wait` (or the next save/restore, or :meth:`close`) to finish.
        """
        check_step(step, "save")
        if self._read_only:
            raise ValueError(f"this Checkpointer of {self.directory} is read-only")
        self._agree(f"save step {int(step)}")
        record = {"format": _FORMAT, "step": int(step), "extra": dict(extra or {}),
                  "saved_by": dict(saved_by or {})}  # fmt: skip
        try:
            record = json.loads(json.dumps(record))  # exactly what restore will return
        except TypeError as err:
            raise TypeError(
                f"extra must be JSON-serialisable ({err}). Remedy: store numbers, strings, lists "
                "and dicts there (e.g. loader.state()); arrays belong in params/opt_state."
            ) from None
        trees = dict(zip(_ITEMS, (params, opt_state, None if rng is None else {_RNG_KEY: rng})))
        items = {item: keyed(item, tree) for item, tree in trees.items() if tree is not None}
        check_not_donated(items)
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
        self.pending_step = int(step)
        lifetime.pending(self)

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
        self.save(step, params, opt_state, extra, rng=rng,
                  saved_by={"optimizer": train_step.fingerprint["optimizer"]})  # fmt: skip

    def restore_train_state(self, train_step, params, opt_state, step: int | None = None) -> Restored:
        """Restore what :meth:`save_train_state` saved into ``train_step``'s layout.

        ``params, opt_state`` come from ``train_step.init(...)`` (they give the
        shardings and memory kinds); the result holds the restored pair.
        """
        params_target, opt_target = train_step.checkpoint_target(params, opt_state)
        # fp16's dynamic loss scale is restored where both sides have one; an fp16 step resumed
        # from another precision starts a fresh scale, and another precision drops a saved one
        saved_scale = self._saved_under(step, "opt_state/loss_scale/")
        scaled = "loss_scale" in opt_target
        if saved_scale is not None and scaled != bool(saved_scale):
            opt_target = {k: v for k, v in opt_target.items() if k != "loss_scale"}
            if saved_scale:  # read nothing of it (None: held elsewhere), for the checks
                opt_target["loss_scale"] = _nested({path: None for path in saved_scale})
        restored = self.restore(step, params=params_target, opt_state=opt_target)
        saved = restored.opt_state if scaled else {k: v for k, v in restored.opt_state.items() if k != "loss_scale"}
        was, now = restored.saved_by.get("optimizer"), train_step.fingerprint["optimizer"]
        if was is not None and was != now:
            warnings.warn(
                f"step {restored.step} of {self.directory} was saved by a step whose optimizer update "
                f"differs from this one's ({was}; now {now}): its optimizer state is restored as saved. "
                "Intended for a new learning rate; otherwise restore with the optimizer it was saved "
                "with (the state of another optimizer of the same shape would be misread).", stacklevel=2)
        params, opt_state = train_step.from_checkpoint(restored.params, saved)
        return dataclasses.replace(restored, params=params, opt_state=opt_state)

    def _agree(self, call: str) -> None:
        """Every process makes ``call`` on this directory within the timeout, or all raise."""
        agree_on_call(host_comm(), "checkpoint", lambda: [f"{call} of {self.directory}"], self._timeout)

    def _saved_under(self, step: int | None, prefix: str) -> list[str] | None:
        """The saved paths under ``prefix`` (without it) of ``step`` (default: the latest);
        ``None`` where the step cannot be read here (:meth:`restore` then says why)."""
        steps = self.all_steps()
        step = steps[-1] if step is None and steps else step
        if step not in steps:
            return None
        try:
            return [p[len(prefix):] for p in self._saved_leaves(step) if p.startswith(prefix)]
        except (DamagedArrayError, OSError, ValueError, KeyError, TypeError):
            return None

    def wait(self) -> None:
        """Block until the pending save (if any) is committed.

        Raises:
            CheckpointError: the save failed (I/O error, disk full); names the
                step and the latest complete one, which is untouched.
        """
        step, self.pending_step = self.pending_step, None
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._failed(step, err) from err
        finally:
            lifetime.settled(self)
        if step is not None:
            lifetime.committed(self.directory)  # a later step committed: nothing is lost

    def _failed(self, step: int | None, err: BaseException) -> CheckpointError:
        """Record a failed save (the process will exit 1 rather than hang) and describe it."""
        steps = self.all_steps()
        kept = f"the latest complete step is {steps[-1]}" if steps else "no complete step exists yet"
        message = (f"saving step {step} to {self.directory} failed: {type(err).__name__}: {err}; "
                   f"{kept} (untouched). Remedy: fix the cause (space, permissions) and save "
                   "again; restore() reads the complete steps.")  # fmt: skip
        lifetime.failed(self.directory, message)
        return CheckpointError(message)

    # --- listing ----------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps on disk, oldest first (in-flight or killed saves, and folders that
        only look like steps, are not listed)."""
        foreign = {int(name) for name in foreign_step_folders(self.directory)}
        return sorted(set(ocp.path.step.checkpoint_steps(self.directory)) - foreign)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def delete(self, step: int) -> None:
        """Delete committed ``step`` (after the pending save), and nothing else of the directory.

        Collective under MPI, like :meth:`save`. Example: start over in place, keeping the
        files beside the checkpoints::

            for step in ckpt.all_steps():
                ckpt.delete(step)
        """
        check_step(step, "delete")
        if self._read_only:
            raise ValueError(f"this Checkpointer of {self.directory} is read-only. Remedy: open it "
                             "with read_only=False to delete steps.")
        self._agree(f"delete step {int(step)}")
        self.wait()
        steps = self.all_steps()
        if int(step) not in steps:
            raise CheckpointError(f"no committed step {int(step)} in {self.directory} to delete "
                                  f"(committed: {steps}). Remedy: delete one of those.")
        self._manager.delete(int(step))

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
            check_step(step, "restore")
        self._agree(f"restore step {step if step is not None else 'latest'}")
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
            if not isinstance(record, dict) or record.get("format") != _FORMAT:
                raise ValueError(f"not a {_FORMAT} record")
        except (OSError, ValueError, KeyError, TypeError) as err:
            err = f"its JSON record 'meta' is unreadable ({err})"
            raise self._damaged(where, step, steps, err) from None
        try:
            saved = self._saved_leaves(step)
        except (DamagedArrayError, OSError, ValueError, KeyError, TypeError) as err:
            raise self._damaged(where, step, steps, err) from None

        param_targets, param_tree = targets("params", params, saved, where)
        opt_targets = opt_tree = None
        if opt_state is not None:
            opt_targets, opt_tree = targets("opt_state", opt_state, saved, where)
        elif optimizer is not None:
            derived = optimizer_target(optimizer, param_targets, param_tree, saved)
            opt_targets, opt_tree = targets("opt_state", derived, saved, where)
        check_complete({"params": param_targets, "opt_state": opt_targets}, saved, where)
        wanted = {**param_targets, **(opt_targets or {})}
        rng_path = f"rng/{_RNG_KEY}"
        if saved.get(rng_path) is not None:
            wanted[rng_path] = None
        reads = {p: t for p, t in wanted.items() if t is not ELSEWHERE}
        try:
            values = self._read(step, reads)
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
            saved_by=record.get("saved_by", {}),
        )

    def _saved_leaves(self, step: int) -> dict[str, LeafMeta | None]:
        """``{path: LeafMeta or None (saved empty)}`` of every item of ``step`` (JSON only)."""
        saved = {}
        for item in _ITEMS:
            directory = self._item_dir(step, item)
            if directory.exists():
                metas = StandardTreeHandler().metadata(directory)
                saved.update({f"{item}/{path}": meta for path, meta in metas.items()})
        return saved

    def _read(self, step: int, reads: Mapping[str, Any]) -> dict[str, Any]:
        """``{path: value}`` of the ``reads`` (``{path: sharding or None}``)."""
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
        """Finish the pending save and the removal of what killed saves left, then release
        orbax's threads and the writer lock.

        Raises :class:`CheckpointError` if that save failed (after releasing)."""
        lifetime.closed(self)
        try:
            self.wait()
        finally:
            with contextlib.suppress(Exception):  # orbax logs a failed removal; the next writer retries
                _await_leftover_removal(self._manager)
            with contextlib.suppress(Exception):  # a failed save's error was raised by wait
                self._manager.close()
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
