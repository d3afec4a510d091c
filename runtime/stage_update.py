"""Optimizer updates that read several pipeline stages' parameters, made exact.

With a pipeline, each stage's parameters live on that stage's mesh (and, across
processes, in another process). Leaf-wise transformations (sgd, adamw,
``MultiSteps`` around them) can run once per stage on that stage's leaves. Those
that combine leaves (``clip_by_global_norm``, ``optax.tree.norm``, anything built
on ``jax.tree.reduce``) cannot: each stage would clip by its own norm.

:class:`StageUpdate` traces the whole update once on the full abstract parameter
tree, inlines calls (``jit``, ``custom_jvp``, …) and turns a ``cond`` whose inputs
span stages into both branches plus a ``select_n``. Every value then has an
*owner*: the one stage whose leaves it depends on, or none (a *global* value:
step counters, constants, results of exchanges). An equation whose inputs belong
to several stages *mixes* them; its stage-owned operands must be small (a
per-stage sum of squares is one scalar): they are exchanged between stages (a
host copy in one process, the host collectives' ``allgather`` across processes) and
the equation runs, identically, on every stage; or, when one stage holds a large
operand (a gradient scaled by a norm that another stage finished), the small
operands come to that stage and it alone computes the equation. The update thus splits into
rounds: each stage computes what it can, the mixing operands are exchanged, the
next round continues. A mixing equation with large operands (whole parameters
moving between stages) is refused with the transformation, the source line and
a remedy.

Example:
    >>> update = StageUpdate.of(placed, master_optimizers, params_abstract, ...)  # doctest: +SKIP
    >>> update is None               # leaf-wise (adamw): per-stage updates are exact  # doctest: +SKIP
    >>> new_params, states = update(params, grads, states, finite)              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import Literal
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner.jaxprs import call_body
from axonn_jax.runtime.master_optimizer import MasterOptimizer, MasterState, state_labels

#: The most elements of one value exchanged between stages (reductions such as a
#: per-stage sum of squares are scalars; whole parameters are refused).
MAX_EXCHANGED_ELEMENTS = 256
#: names of the primitives that split keys and draw bits (``random_split``, ``threefry2x32``)
RANDOM = ("random_", "threefry")


@dataclasses.dataclass
class _Op:
    """One equation of the flattened update (``primitive`` None: a copy)."""

    primitive: Any
    params: dict
    args: list[int]
    outs: list[int]
    exchanged: frozenset[int]  # args read from the exchange (other stages' small values)
    owner: int | None
    round: int


class _Tracer:
    """Flattens the traced update and follows owners, leaf dependencies and rounds."""

    def __init__(self, describe: str, paths: Sequence[str]):
        self.describe, self.paths = describe, paths
        self.owner: list[int | None] = []
        self.deps: list[frozenset] = []
        self.round: list[int] = []
        self.shape: list[tuple] = []
        self.consts: dict[int, Any] = {}
        self.ops: list[_Op] = []
        self.published: set[int] = set()

    def new(self, owner, deps, rnd, shape) -> int:
        self.owner.append(owner)
        self.deps.append(deps)
        self.round.append(rnd)
        self.shape.append(tuple(shape))
        return len(self.owner) - 1

    def const(self, value) -> int:
        k = self.new(None, frozenset(), 0, np.shape(value))
        self.consts[k] = value
        return k

    def flatten(self, jaxpr, consts, args: list[int]) -> list[int]:
        env = dict(zip(jaxpr.constvars, (self.const(c) for c in consts)))
        env.update(zip(jaxpr.invars, args))
        read = lambda v: self.const(v.val) if isinstance(v, Literal) else env[v]  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            body = call_body(eqn)
            if body is not None:
                outs = self.flatten(*body, ins)
            elif eqn.primitive.name == "cond" and self._spans_stages(ins):
                outs = self._cond_as_select(eqn, ins)
            else:
                outs = self.emit(eqn.primitive, eqn.params, ins, [v.aval.shape for v in eqn.outvars],
                                 _where(eqn))  # fmt: skip
            env.update((v, o) for v, o in zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def draws_random_bits(self) -> bool:
        """Whether the update draws random numbers from state every stage shares
        (``optax.noisy_sgd`` splits its key into one per leaf of the whole tree): run per
        stage, each stage would split it by its own leaves, and two stages' leaves would
        get the same noise; run from this trace, each gets its own."""
        return any(op.owner is None and op.primitive is not None and op.primitive.name.startswith(RANDOM)
                   for op in self.ops)  # fmt: skip

    def _spans_stages(self, ins) -> bool:
        return len({self.owner[a] for a in ins} - {None}) > 1

    def _cond_as_select(self, eqn, ins) -> list[int]:
        """A ``cond`` over several stages: every branch, then ``select_n`` on the index."""
        index, operands = ins[0], ins[1:]
        branches = [self.flatten(b.jaxpr, b.consts, operands) for b in eqn.params["branches"]]
        return [self.emit(lax.select_n_p, {}, [index, *cases], [self.shape[cases[0]]], _where(eqn))[0]
                for cases in zip(*branches)]  # fmt: skip

    def emit(self, primitive, params, ins, shapes, where: str, force_mixing: bool = False) -> list[int]:
        stages = {self.owner[a] for a in ins} - {None}
        mixing = force_mixing and bool(stages) or len(stages) > 1
        large = {self.owner[a] for a in ins if self.owner[a] is not None
                 and math.prod(self.shape[a]) > MAX_EXCHANGED_ELEMENTS}  # fmt: skip
        if mixing and len(large) == 1 and not force_mixing:
            # e.g. a gradient of stage 0 scaled by a norm finished on stage 1: the other stages'
            # (small) operands come to the stage holding the large one, which computes it
            (owner,) = large
            exchanged = frozenset(a for a in ins if self.owner[a] not in (None, owner))
        else:
            owner = None if mixing else next(iter(stages), None)
            exchanged = frozenset(a for a in ins if mixing and self.owner[a] is not None)
        for a in exchanged:
            self._check_small(a, primitive, where, stages)
            self.published.add(a)
        if owner is None and mixing:
            deps = frozenset()  # the same value on every stage
        else:
            deps = frozenset().union(*(self.deps[a] for a in ins if a not in exchanged))
        rnd = max((self.round[a] + (a in exchanged) for a in ins), default=0)
        outs = [self.new(owner, deps, rnd, s) for s in shapes]
        self.ops.append(_Op(primitive, params, list(ins), outs, exchanged, owner, rnd))
        return outs

    def _check_small(self, a, primitive, where, stages) -> None:
        size = math.prod(self.shape[a])
        if size > MAX_EXCHANGED_ELEMENTS:
            name = "output" if primitive is None else f"`{primitive.name}`"
            leaf = self.paths[min(self.deps[a])] if self.deps[a] else "?"
            raise ValueError(
                f"optimizer {self.describe} combines the parameters of pipeline stages "
                f"{sorted(stages)} in {name} at {where}, with an operand of shape "
                f"{list(self.shape[a])} ({size} elements, from e.g. '{leaf}' on stage "
                f"{self.owner[a]}); an exact update would move whole parameters between stages "
                f"(at most {MAX_EXCHANGED_ELEMENTS} elements per value are exchanged), and per-stage "
                "updates would silently differ. Remedy: a transformation that combines "
                "stages only through small values (e.g. optax.clip_by_global_norm), "
                "optax.multi_transform so that this one runs within a stage, or a grid with pipeline=1."
            )


def _owners(placed, trainable: Sequence[int]) -> tuple[list[int], list[str]]:
    """Each trained parameter's owner (the first stage that uses it; stage 0 if none does),
    and its path: how the traced update and init attribute values to stages."""
    owners = [placed.homes.users[i][0] if placed.homes.users[i] else 0 for i in trainable]
    return owners, [placed.plan.params[i].path for i in trainable]


def init_mixing(placed, optimizer, abstract_params, trainable: Sequence[int]) -> str | None:
    """Where ``optimizer.init`` combines parameters of several pipeline stages (``None``: it
    does not, and each stage can initialise its own state). ``optax.contrib.dog``'s default
    first step reads the norm of every parameter; per stage, each would read only its own.

    Example:
        >>> init_mixing(placed, optax.adam(1e-3), abstract, trainable)  # doctest: +SKIP
        None
    """
    owner_of, paths = _owners(placed, trainable)
    closed = jax.make_jaxpr(optimizer.init)(abstract_params)
    tracer = _Tracer(describe(optimizer), paths)
    in_ids = [tracer.new(owner_of[k], frozenset({k}), 0, v.aval.shape) for k, v in enumerate(closed.jaxpr.invars)]
    try:
        tracer.flatten(closed.jaxpr, closed.consts, in_ids)
    except ValueError as err:  # whole parameters would move between stages
        return str(err)
    if not tracer.published:
        return None
    a = min(tracer.published)
    leaf = paths[min(tracer.deps[a])] if tracer.deps[a] else "?"
    return f"a value of shape {list(tracer.shape[a])} from '{leaf}' (stage {tracer.owner[a]}) meets other stages'"


def _where(eqn) -> str:
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - a nicer message only
        return "an unknown source line"


def describe(optimizer) -> str:
    """A transformation's name for messages, e.g. ``optax chain.<locals>.update_fn``."""
    update = getattr(optimizer, "update", optimizer)
    name = getattr(update, "__qualname__", type(optimizer).__name__)
    return f"{type(optimizer).__name__} ({getattr(update, '__module__', '?')}.{name})"


@dataclasses.dataclass
class _Unit:
    """One local stage's share of the rounds."""

    stage: int
    inputs: list[int]  # full input positions this stage holds, in its flatten order
    outputs: list[int]  # full output positions it returns
    programs: list  # per round: (jitted, input keys, output keys) or None
    publish: list[list[int]]  # per round: the ids this stage publishes after it


class StageUpdate:
    """The exact whole-model update of a pipeline, split into rounds over stages.

    Build with :meth:`of`, which returns ``None`` when per-stage updates are
    already exact (no output mixes stages).
    """

    def __init__(self, tracer: _Tracer, in_ids, out_ids, units, masters, meshes, host):
        self.tracer, self.in_ids, self.out_ids = tracer, in_ids, out_ids
        self.units, self.masters, self.meshes, self.host = units, masters, meshes, host
        self.rounds = max((tracer.round[o] for o in out_ids), default=0) + 1

    @classmethod
    def of(cls, placed, masters: dict[int, MasterOptimizer], abstract_params,
           trainable: Sequence[int] | None = None) -> StageUpdate | None:  # fmt: skip
        """Trace ``masters``' update on the full ``abstract_params``; ``None`` if separable.

        Args:
            placed: the :class:`~axonn_jax.runtime.placement.PlacedModel`.
            masters: local stage → its :class:`MasterOptimizer` (same optimizer and precision).
            abstract_params: ShapeDtypeStructs of every trained parameter (the plan's tree,
                or of a model with state its ``params`` alone).
            trainable: the plan's indices of the leaves of ``abstract_params``, in order
                (default: every parameter of the plan).
        """
        master = next(iter(masters.values()))
        plan = placed.plan
        trainable = list(range(len(plan.params)) if trainable is None else trainable)
        n = len(trainable)
        owner_of, paths = _owners(placed, trainable)
        params = jax.eval_shape(master.precision.to_device, abstract_params)
        state = jax.eval_shape(_full_state(master), abstract_params)
        finite = jax.ShapeDtypeStruct((), np.bool_) if master.precision.half else None
        grad_scale = jax.ShapeDtypeStruct((), np.float32) if master.precision.loss_scaling else None
        args = (params, params, state, finite, grad_scale)
        closed = jax.make_jaxpr(master.step_on_device)(*args)
        inner_labels = state_labels(master.optimizer, state.inner, abstract_params)
        own = list(range(n))
        in_labels = own + own + (own if master.keeps_master else []) + inner_labels
        in_labels += [-1] * ((finite is not None) + (grad_scale is not None))  # shared by every stage
        out_labels = own + (own if master.keeps_master else []) + inner_labels
        if len(in_labels) != len(closed.jaxpr.invars) or len(out_labels) != len(closed.jaxpr.outvars):
            raise ValueError(
                f"optimizer {describe(master.optimizer)}: its state could not be matched to the "
                "parameters, so its update cannot be split over pipeline stages. Remedy: a "
                "transformation whose state follows optax.tree_map_params, or pipeline=1."
            )
        tracer = _Tracer(describe(master.optimizer), paths)
        in_ids = [tracer.new(None if lab < 0 else owner_of[lab], frozenset() if lab < 0 else {lab}, 0,
                             v.aval.shape) for lab, v in zip(in_labels, closed.jaxpr.invars)]  # fmt: skip
        out_ids = tracer.flatten(closed.jaxpr, closed.consts, in_ids)
        for k, (lab, o) in enumerate(zip(out_labels, out_ids)):
            if lab < 0 and tracer.owner[o] is not None:  # shared state must agree on every stage
                out_ids[k] = tracer.emit(None, {}, [o], [tracer.shape[o]], "a shared state entry",
                                         force_mixing=True)[0]  # fmt: skip
            elif lab >= 0 and tracer.owner[out_ids[k]] not in (None, owner_of[lab]):
                o = out_ids[k]
                raise ValueError(
                    f"optimizer {tracer.describe}: the update of '{paths[lab]}' (stage "
                    f"{owner_of[lab]}) depends on '{paths[min(tracer.deps[o])]}' of stage "
                    f"{tracer.owner[o]}; per-stage updates would be wrong and an exact one would move "
                    "whole parameters between stages. Remedy: a leaf-wise transformation, or pipeline=1."
                )
        if not tracer.published and not tracer.draws_random_bits():
            return None
        groups = placed.homes.groups()
        held = {s: {k for k, i in enumerate(trainable) if i in set(groups[s])} for s in masters}
        units = [_unit(tracer, s, held[s], placed.meshes[s], in_labels, out_labels, in_ids, out_ids)
                 for s in sorted(masters)]  # fmt: skip
        return cls(tracer, in_ids, out_ids, units, masters, placed.meshes, placed.host)

    def __call__(self, params: dict, grads: dict, states: dict, finite, grad_scale=None) -> tuple[dict, dict]:
        """``{stage: params subtree}``, ... → ``({stage: new params}, {stage: new MasterState})``;
        ``finite`` and ``grad_scale`` (fp16's loss scale, a host value) as the step's update takes them."""
        envs, exchanged = {}, {}
        for u in self.units:
            leaves = jax.tree.leaves((params[u.stage], grads[u.stage], states[u.stage], finite, grad_scale))
            if len(leaves) != len(u.inputs):
                raise ValueError(
                    f"stage {u.stage}'s optimizer state does not match the traced update "
                    f"({len(leaves)} leaves, {len(u.inputs)} expected). Remedy: use step.init's opt_state."
                )
            envs[u.stage] = {self.in_ids[k]: leaf for k, leaf in zip(u.inputs, leaves)}
        for r in range(self.rounds):
            mine = {}
            for u in self.units:
                env, program = envs[u.stage], u.programs[r]
                if program is not None:
                    run, in_keys, out_keys = program
                    mesh = self.meshes[u.stage]
                    values = [env[k] if not isinstance(k, tuple) else
                              jax.device_put(exchanged[k[1]], NamedSharding(mesh, P())) for k in in_keys]  # fmt: skip
                    env.update(zip(out_keys, run(*values)))
                for i in u.publish[r]:
                    value = env[i]  # a small input leaf may still be sharded: every element goes
                    if not value.sharding.is_fully_replicated:
                        value = jax.device_put(value, NamedSharding(self.meshes[u.stage], P()))
                    mine[i] = np.asarray(value.addressable_data(0))
            if r + 1 < self.rounds:
                for part in self.host.allgather(mine):
                    for i, value in part.items():
                        exchanged.setdefault(i, value)
        new_params, new_states = {}, {}
        for u in self.units:
            env, mesh = envs[u.stage], self.meshes[u.stage]
            values = [self._value(env, self.out_ids[k], mesh) for k in u.outputs]
            tree = jax.tree.structure((params[u.stage], states[u.stage]))
            p, s = jax.tree.unflatten(tree, values)
            master = self.masters[u.stage]
            p = jax.device_put(p, master.param_shardings)
            s = jax.device_put(s, master.state_shardings(s.master if master.keeps_master else p))
            new_params[u.stage], new_states[u.stage] = p, s
        return new_params, new_states

    def _value(self, env, i, mesh):
        if i in self.tracer.consts:
            return jax.device_put(np.asarray(self.tracer.consts[i]), NamedSharding(mesh, P()))
        return env[i]


def _full_state(master: MasterOptimizer):
    def init(params):
        masters = jax.tree.map(lambda p: p.astype(master.precision.master_dtype), params)
        return MasterState(masters if master.keeps_master else None, master.optimizer.init(masters))

    return init


def _unit(tracer: _Tracer, stage: int, held: set[int], mesh, in_labels, out_labels, in_ids,
          out_ids) -> _Unit:  # fmt: skip
    """What stage ``stage`` (holding parameters ``held``) computes in each round."""
    inputs = [k for k, lab in enumerate(in_labels) if lab < 0 or lab in held]
    outputs = [k for k, lab in enumerate(out_labels) if lab < 0 or lab in held]
    needed = {out_ids[k] for k in outputs}
    needed |= {i for i in tracer.published if tracer.owner[i] == stage}
    computed: list[_Op] = []
    for op in reversed(tracer.ops):
        if not needed.intersection(op.outs):
            continue
        if op.owner is not None and op.owner != stage and not tracer.deps[op.outs[0]] <= held:
            raise ValueError(
                f"optimizer {tracer.describe}: stage {stage} needs a value computed from parameters "
                f"of stage {op.owner} that it does not hold. Remedy: pipeline=1."
            )  # internal: outputs are checked before
        computed.append(op)
        needed.update(a for a in op.args if a not in op.exchanged)
    computed.reverse()
    rounds = max(tracer.round[o] for o in out_ids) + 1
    available = {in_ids[k] for k in inputs} | set(tracer.consts)
    programs, publish = [], []
    later_uses: dict[int, int] = {}
    for op in computed:
        for a in op.args:
            later_uses[a] = max(later_uses.get(a, -1), op.round)
    final = {out_ids[k] for k in outputs}
    for r in range(rounds):
        ops = [op for op in computed if op.round == r]
        produced = {o for op in ops for o in op.outs}
        pub = [i for op in ops for i in op.outs if i in tracer.published and tracer.owner[i] == stage]
        pub += [i for i in sorted(tracer.published) if tracer.owner[i] == stage and i in available
                and tracer.round[i] == r and i not in pub]  # fmt: skip
        publish.append(pub)
        if not ops:
            programs.append(None)
            continue
        in_keys: list = []
        for op in ops:
            for a in op.args:
                key = ("x", a) if a in op.exchanged else a
                if key not in in_keys and a not in tracer.consts and not (key == a and a in produced):
                    in_keys.append(key)
        out_keys = [o for o in sorted(produced) if o in final or o in pub or later_uses.get(o, -1) > r]
        run = _program(tracer, ops, in_keys, out_keys, set(pub), mesh)
        programs.append((jax.jit(run), in_keys, out_keys))
        available |= produced
    return _Unit(stage, inputs, outputs, programs, publish)


def _program(tracer: _Tracer, ops: list[_Op], in_keys: list, out_keys: list[int], replicate: set[int],
             mesh) -> Callable:  # fmt: skip
    """A round's equations of one stage as a function of ``in_keys`` → ``out_keys``."""

    def run(*values):
        env = dict(zip(in_keys, values))
        for op in ops:
            args = []
            for a in op.args:
                if a in tracer.consts:
                    args.append(tracer.consts[a])
                else:
                    args.append(env[("x", a)] if a in op.exchanged else env[a])
            if op.primitive is None:
                outs = args
            else:
                outs = op.primitive.bind(*args, **op.params)
                outs = outs if op.primitive.multiple_results else [outs]
            env.update(zip(op.outs, outs))
        # published values leave through one device: replicated on the stage mesh
        everywhere = NamedSharding(mesh, P())
        return [lax.with_sharding_constraint(env[k], everywhere) if k in replicate else env[k]
                for k in out_keys]  # fmt: skip

    return run
