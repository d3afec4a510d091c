"""A planned model on this process's devices: meshes, parameter homes, shardings.

:class:`ParamHomes` says which pipeline stages use each parameter and where
this process keeps it (the first local stage that uses it; ``None`` when no
local stage does). :class:`PlacedModel` holds the stage meshes of a
:class:`~axonn_jax.partitioner.plan.Plan` and does everything that needs them:
parameter shardings, sharded init, placing and gathering full parameters,
and the checks that a params pytree matches the plan.

Example:
    >>> placed = PlacedModel(plan, stage_meshes(plan.grid))        # doctest: +SKIP
    >>> params = placed.init(program.traced.init, jax.random.key(0))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.trace import path_string
from axonn_jax.runtime.collectives import HostCollectives, host_comm
from axonn_jax.runtime.mesh import local_stages
from axonn_jax.runtime.model_call import is_params_of_state, state_collections
from axonn_jax.runtime.sharded import place, replicate
from axonn_jax.runtime.pipeline.transport import InProcessTransport, MpiTransport, Transport


@dataclasses.dataclass(frozen=True)
class ParamHomes:
    """Which stages use which parameters, and each parameter's home stage here.

    ``home[i]`` is the first stage on this process that uses parameter ``i``
    (stage 0 for a parameter no stage uses), or ``None`` when no stage of this
    process needs it.
    """

    users: tuple[tuple[int, ...], ...]
    local: tuple[int, ...]
    home: tuple[int | None, ...]

    @classmethod
    def of(cls, plan: Plan, local: Sequence[int]) -> ParamHomes:
        users = [[st.index for st in plan.stages if p.path in st.params] for p in plan.params]
        home = []
        for stages in users:
            here = [s for s in stages if s in local] or ([0] if not stages and 0 in local else [])
            home.append(here[0] if here else None)
        return cls(tuple(map(tuple, users)), tuple(local), tuple(home))

    def is_local(self, i: int) -> bool:
        return self.home[i] is not None

    def shared(self) -> list[int]:
        """Parameters used by more than one stage."""
        return [i for i, stages in enumerate(self.users) if len(stages) > 1]

    def groups(self) -> dict[int, list[int]]:
        """Home stage → the parameters kept there (this process only)."""
        out: dict[int, list[int]] = {}
        for i, home in enumerate(self.home):
            if home is not None:
                out.setdefault(home, []).append(i)
        return out


class PlacedModel:
    """A :class:`Plan` on its stage meshes (one per pipeline stage, stage 0 first)."""

    def __init__(self, plan: Plan, meshes: Sequence[jax.sharding.Mesh]):
        self.plan, self.grid = plan, plan.grid
        self.meshes = list(meshes)
        self.local = local_stages(self.meshes)
        self.homes = ParamHomes.of(plan, self.local)
        by_stage = [{d.process_index for d in m.devices.flat} for m in self.meshes]
        processes = set().union(*by_stage)
        self.multiprocess = len(processes) > 1
        #: some stage has no devices on some process: parameters are held apart, per process
        self.spread = any(stage != processes for stage in by_stage)
        self._transport: Transport | None = None
        #: the host collectives of the processes of these meshes
        self.host: HostCollectives = host_comm()

    @property
    def transport(self) -> Transport:
        """How stages and processes exchange messages (in-process copies, or MPI)."""
        if self._transport is None:
            self._transport = MpiTransport(self.meshes) if self.multiprocess else InProcessTransport()
        return self._transport

    # --- shardings --------------------------------------------------------
    @property
    def param_shardings(self):
        """NamedSharding pytree matching the params pytree (``None`` for other processes' leaves)."""
        home = self.homes.home
        leaves = [None if home[i] is None else NamedSharding(self.meshes[home[i]], p.spec)
                  for i, p in enumerate(self.plan.params)]  # fmt: skip
        return jax.tree.unflatten(self.plan.param_tree, leaves)

    def subtree(self, leaves: list, keep: Sequence[int]):
        """The params pytree with only the leaves ``keep`` (others ``None``)."""
        picked = [leaf if i in keep else None for i, leaf in enumerate(leaves)]
        return jax.tree.unflatten(self.plan.param_tree, picked)

    # --- parameters -------------------------------------------------------
    def init(self, init_fn: Callable, key: jax.Array):
        """``init_fn(key)`` (full params) computed directly in the sharded layout.

        One program per local stage (per home mesh), each keeping only its leaves.
        """
        shardings = jax.tree.leaves(self.param_shardings, is_leaf=lambda x: x is None)
        leaves: list = [None] * len(shardings)
        for mine in self.homes.groups().values():

            def init_stage(k, mine=mine):
                full = jax.tree.leaves(init_fn(k))
                return [full[i] for i in mine]

            values = jax.jit(init_stage, out_shardings=[shardings[i] for i in mine])(key)
            for i, v in zip(mine, values):
                leaves[i] = v
        return jax.tree.unflatten(self.plan.param_tree, leaves)

    def shard(self, full_params):
        """Place a full params pytree (e.g. pretrained weights) into the layout."""
        self.check_params(full_params)
        leaves = jax.tree.leaves(full_params)
        shardings = jax.tree.leaves(self.param_shardings, is_leaf=lambda x: x is None)
        placed = [None if sh is None else place(np.asarray(leaf), sh)
                  for leaf, sh in zip(leaves, shardings)]  # fmt: skip
        return jax.tree.unflatten(self.plan.param_tree, placed)

    def gather(self, params, *, state_holes: bool = False):
        """Full parameters as host NumPy arrays, on every process.

        ``state_holes``: model-state leaves may be ``None`` (gathering the ``params`` alone).
        """
        leaves = self.param_leaves(params, state_holes=state_holes)
        self.check_params(params, dtypes=False, state_holes=state_holes)
        out: list = [None] * len(leaves)
        groups: dict = {}
        for i, leaf in enumerate(leaves):
            mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
            if mesh is not None:
                groups.setdefault(mesh, []).append(i)
            elif leaf is not None:  # on no mesh: host data, or a constant a jitted step returned whole
                out[i] = np.asarray(leaf)
        for mesh, idx in groups.items():
            for i, a in zip(idx, replicate([leaves[i] for i in idx], mesh)):
                out[i] = np.asarray(a.addressable_data(0))
        if self.spread:  # leaves held elsewhere: the same decision on every rank
            for part in self.host.allgather([(i, a) for i, a in enumerate(out) if a is not None]):
                for i, a in part:
                    out[i] = a if out[i] is None else out[i]
        return jax.tree.unflatten(self.plan.param_tree, out)

    def param_leaves(self, params, *, state_holes: bool = False, unread_holes: bool = False) -> list:
        """Leaves of a params pytree (``None`` kept for leaves of other processes)."""
        check_not_donated(params)
        leaves, tree = jax.tree.flatten(params, is_leaf=lambda x: x is None)
        if tree != self.plan.param_tree or len(leaves) != len(self.plan.params):
            self.check_params(params)
        if any(leaf is None and h is not None for leaf, h in zip(leaves, self.homes.home)):
            self.check_params(params, state_holes=state_holes, unread_holes=unread_holes)
        return leaves

    def check_params(self, params, *, dtypes: bool = True, state_holes: bool = False,
                     unread_holes: bool = False) -> None:  # fmt: skip
        """Raise ``ValueError`` naming the first leaf that does not match the plan.

        ``dtypes=False`` accepts floating leaves of another precision (the
        half-precision device parameters of ``train_step(precision=...)``);
        ``state_holes=True``, ``None`` for model state (BatchNorm statistics);
        ``unread_holes=True``, ``None`` for leaves no stage reads (a forward pass
        over variables that another plan of the model laid out: its dropout
        stream's counter, which an evaluation program never reads).
        """
        plan = self.plan
        check_not_donated(params)
        leaves_with_path, tree = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: x is None)
        if tree != plan.param_tree:
            if is_params_of_state(params, plan.param_tree):
                state = state_collections(plan.param_tree)
                raise ValueError(
                    f"these are the 'params' alone, but the model has state ({', '.join(state)}) "
                    f"and runs on its whole variables dict. Remedy: pass the whole variables dict "
                    f"(params and {' and '.join(state)}), e.g. {{**variables, 'params': params}} "
                    "with variables from pm.init / pm.shard(model.init(...))."
                )
            expected = {p.path for p in plan.params}
            got = {path_string(k) for k, _ in leaves_with_path}
            raise ValueError(
                "params pytree does not match the plan: missing "
                f"{sorted(expected - got) or 'none'}, unexpected {sorted(got - expected) or 'none'}. "
                "Remedy: pass the pytree returned by pm.init / pm.shard (or model.init(...)['params'])."
            )
        for i, ((_, leaf), p) in enumerate(zip(leaves_with_path, plan.params)):
            if leaf is None:
                hole_allowed = (state_holes and not p.trainable) or (unread_holes and not self.homes.users[i])
                if self.homes.home[i] is not None and not hole_allowed:
                    where = ("runs a stage that uses it" if self.homes.users[i] else
                             "keeps it (no stage reads it; such a leaf is kept with stage 0)")  # fmt: skip
                    raise ValueError(
                        f"parameter '{p.path}' is None but this process {where} "
                        f"(grid {self.grid}). Remedy: pass the pytree from pm.init / pm.shard; "
                        "for variables laid out by another plan of this model (its training "
                        "program, where this one evaluates), partition this one with "
                        "stages=that_pm.plan.stage_cuts, so that its stages hold the same parameters."
                    )
                continue
            shape, dtype = tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", np.float32))
            if shape != p.shape:
                raise ValueError(
                    f"parameter '{p.path}' has shape {shape}, the plan expects {p.shape} "
                    f"(grid {self.grid}). Remedy: re-partition for this model size."
                )
            planned = np.dtype(p.dtype)
            both_float = jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(planned, jnp.floating)
            if dtype != planned and (dtypes or not both_float):
                raise ValueError(
                    f"parameter '{p.path}' has dtype {dtype}, the plan expects {p.dtype}. "
                    "Remedy: cast the params (e.g. jax.tree.map(lambda x: x.astype(...))) or "
                    "re-partition with parameters of that dtype."
                )



def check_not_donated(tree, what: str = "parameter") -> None:
    """Refuse arrays whose memory a step took (donated inputs), naming the leaf and the remedy.

    Tracers (inside ``jax.jit``) are not looked at: only concrete arrays can be deleted.

        >>> check_not_donated(old_params)  # doctest: +SKIP
        ValueError: parameter "['dense']['kernel']" was donated to a step ... Remedy: use the params it returned
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
            raise ValueError(
                f"{what} '{jax.tree_util.keystr(path)}' has been deleted: it was donated to a step "
                "(pm.train_step's step, or a jax.jit with donate_argnums), whose outputs took its "
                "memory. Remedy: use what the step returned "
                "(params, opt_state, loss = step(params, opt_state, batch)) from then on; to keep "
                "older values, copy them before the step (jax.tree.map(jnp.copy, params)) or "
                "pm.gather them."
            )
