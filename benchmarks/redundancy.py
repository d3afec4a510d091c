"""Repeated work and memory: per-device FLOPs and parameters vs the plain model.

For each model × grid: the compiled per-device program of one loss-and-
gradient step (``jax.jit(pm.value_and_grad(loss))``) is asked for its FLOPs
(XLA's ``cost_analysis()``), multiplied by the number of devices and divided
by the FLOPs of the plain single-device ``jax.value_and_grad`` compiled in the
same process: 1.00 means the work is split with nothing repeated. The
parameter fraction is the bytes one device holds over the model's total
(ideal ``1/(x·y·z)``). Loss and gradients are checked against the plain model
in the same run (``max_err``).

Run (8 simulated CPU devices)::

    .venv/bin/python benchmarks/redundancy.py                    # all families × 4 grids
    .venv/bin/python benchmarks/redundancy.py --models hf_gpt2 --grids x=4,data=2
    .venv/bin/python benchmarks/redundancy.py --dropout 0.1     # train mode, dropout on
    .venv/bin/python benchmarks/redundancy.py --idioms          # tests/idiom_cases.py × 5 grids
    .venv/bin/python benchmarks/redundancy.py --pipeline-loss   # GPT on pipeline grids, loss planned or not
    .venv/bin/python benchmarks/redundancy.py --planned-loss    # GPT on one mesh, loss planned or not
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()  # fmt: skip
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import functools
import json

import jax
import numpy as np

#: the grids issue 15 names (8 devices each)
GRIDS = ("x=2,y=2,z=2", "z=4,data=2", "x=4,data=2", "y=2,z=2,data=2")
#: pipeline grids of the planned-loss table (--pipeline-loss)
PIPELINE_GRIDS = ("pipeline=2,x=2,z=2", "pipeline=2,x=4", "pipeline=2,x=2,y=2")
#: one-mesh grids of the planned-loss table (--planned-loss; issue 27's target: ≤ 1.03 planned)
LOSS_GRIDS = ("x=4,data=2", "x=2,y=2,z=2")
#: the grids of the idiom models' table (tests/test_idioms.py)
IDIOM_GRIDS = ("x=2,y=2,z=2", "x=4,data=2", "z=2,data=4", "x=2,z=2,data=2", "y=2,z=2,data=2")


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    grid: str
    redundancy: float  # devices × per-device FLOPs / single-device FLOPs
    param_fraction: float  # parameter bytes per device / total
    ideal_fraction: float  # 1 / (x·y·z)
    #: largest |difference| of loss and gradients vs the plain model, relative (a gradient
    #: leaf: to its largest entry + 10% of the model's largest; tests/test_partition's bound
    #: is 1e-5 of that)
    max_err: float
    warnings: int


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def traced_compute(model, args: tuple, loss, grid, kwargs: dict | None = None):
    """``(ComputeReport, pm)`` of one loss-and-gradient step, counted on the traced programs.

    No compilation: FLOPs per device of ``pm.value_and_grad(loss)`` (the loss
    included) against the plain ``jax.value_and_grad``, per source line.
    ``kwargs``: the call's keywords (``deterministic=False, rngs=...``: dropout on).
    """
    import axonn_jax
    from axonn_jax.partitioner.flops import ComputeReport, count

    kwargs = kwargs or {}
    variables = model.init(jax.random.key(0), *args)
    plain = count(jax.make_jaxpr(jax.value_and_grad(lambda v: loss(model.apply(v, *args, **kwargs),
                                                                   *args)))(variables))  # fmt: skip
    pm = axonn_jax.partition(model, grid, *args, **kwargs)
    step = pm.value_and_grad(lambda out, b: loss(out, *b))
    rngs = {"rngs": kwargs["rngs"]} if "rngs" in kwargs else {}
    split = count(jax.make_jaxpr(lambda p, b: step(p, b, **rngs))(pm.shard(variables), tuple(args)))
    return ComputeReport(split, plain, grid.size), pm


def pipeline_loss_compute(model, args: tuple, loss, grid) -> tuple:
    """``(loss after the gathered outputs, loss planned with the last stage)``: ComputeReports of one
    pipelined loss-and-gradient step (one microbatch), counted on the traced stage programs the
    dispatch queue runs (forward and backward; the last stage's forward+loss+backward)."""
    import axonn_jax
    from axonn_jax.partitioner.flops import ComputeReport, count
    from axonn_jax.partitioner.trace import call_leaves
    from axonn_jax.runtime.loss_program import BATCH_KEYWORD, ScalarLoss

    variables = model.init(jax.random.key(0), *args)
    plain = count(jax.make_jaxpr(jax.value_and_grad(lambda v: loss(model.apply(v, *args), *args)))(variables))
    pm = axonn_jax.partition(model, grid, *args)
    engine, loss_fn = pm.engine, ScalarLoss(lambda out, b: loss(out, *b))
    params = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pm.plan.params]  # of the whole leaves
    batch = tuple(args)
    reports = []
    for kwargs, build in (({}, engine.stages.training), ({BATCH_KEYWORD: batch}, engine.stages.planned_training)):
        _, programs = build(tuple(args), kwargs, loss_fn, remat=None, call=engine.call)
        arrays, _ = call_leaves(tuple(args), kwargs)
        total = None
        for st in programs:
            mine = [params[i].update(shape=st.flow.param_shape(i, params[i].shape)) for i in st.flow.params]
            given = [arrays[j] for j in st.flow.args]
            inbound = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in st.flow.inbound]
            if st.last:
                flops = count(jax.make_jaxpr(st._forward_backward)(mine, given, inbound, None if kwargs else batch))
            else:
                fwd, (outs, residuals) = jax.make_jaxpr(st._forward, return_shape=True)(mine, given, inbound)
                cts = [jax.ShapeDtypeStruct(outs[i].shape, outs[i].dtype) for i in st.diff_out]
                leaves, tree = jax.tree.flatten(residuals)
                bwd = jax.make_jaxpr(lambda r, ct: st._backward(jax.tree.unflatten(tree, r), ct))(leaves, cts)
                flops = count(fwd) + count(bwd)
            total = flops if total is None else total + flops
        reports.append(ComputeReport(total, plain, grid.stage_size))
    return tuple(reports)


def model_loss_compute(model, args: tuple, loss, grid) -> tuple:
    """``(loss after the gathered outputs, loss planned with the model)``: ComputeReports of one
    loss-and-gradient step on one mesh (``pipeline=1``), traced: ``loss(pm.apply(...))`` under
    ``jax.value_and_grad`` against ``pm.value_and_grad(loss)``."""
    from axonn_jax.partitioner.flops import ComputeReport, count

    planned, pm = traced_compute(model, args, loss, grid)  # its plain count and partition serve both
    gathered = count(jax.make_jaxpr(jax.value_and_grad(lambda p: loss(pm.apply(p, *args), *args)))(pm.param_structs))
    return ComputeReport(gathered, planned.plain, grid.size), planned


def loss_table(entries: dict, grids) -> tuple[str, list[dict]]:
    """Markdown and rows: whole-step redundancy, loss included, before/after planning the loss
    (with the last stage on pipeline grids, with the model on one mesh)."""
    from axonn_jax import Grid

    rows = []
    lines = ["| model | grid | loss after gathered outputs | loss planned | ratio |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, (model, args, loss) in entries.items():
        for text in grids:
            grid = Grid.parse(text)
            compute = pipeline_loss_compute if grid.pipeline > 1 else model_loss_compute
            before, after = compute(model, args, loss, grid)
            lines.append(f"| {name} | `{text}` | {before.redundancy:.3f} | {after.redundancy:.3f} | "
                         f"{after.redundancy / before.redundancy:.3f} |")  # fmt: skip
            rows.append({"model": name, "grid": text, "gathered": before.redundancy, "planned": after.redundancy})
            print(lines[-1], flush=True)
    return "\n".join(lines), rows


def measure(name: str, model, args: tuple, loss, grid_text: str, kwargs: dict | None = None) -> Row:
    """One row: compile both programs in this process, compare FLOPs, bytes and numbers."""
    import axonn_jax
    from axonn_jax import Grid

    kwargs = kwargs or {}
    grid = Grid.parse(grid_text)
    key = jax.random.key(0)
    variables = model.init(key, *args)
    batch = tuple(args)

    def plain(v):
        return loss(model.apply(v, *batch, **kwargs), *batch)

    single = jax.jit(jax.value_and_grad(plain))
    base_flops = flops(single.lower(variables).compile())
    want_loss, want_grads = single(variables)

    pm = axonn_jax.partition(model, grid, *args, **kwargs)
    params = pm.shard(variables)
    rngs = {"rngs": kwargs["rngs"]} if "rngs" in kwargs else {}
    step = jax.jit(functools.partial(pm.value_and_grad(lambda out, b: loss(out, *b)), **rngs))
    compiled = step.lower(params, batch).compile()
    per_device = flops(compiled)
    got_loss, got_grads = step(params, batch)
    got_grads = pm.gather(got_grads)
    errors = [abs(float(got_loss) - float(want_loss)) / max(1.0, abs(float(want_loss)))]
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want_grads))
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        w = np.asarray(w)  # relative to the leaf's largest gradient, floored at 10% of the model's
        errors.append(float(np.max(np.abs(np.asarray(g) - w))) / (float(np.max(np.abs(w))) + 0.1 * scale))
    plan = pm.plan
    return Row(
        model=name,
        grid=grid_text,
        redundancy=per_device * grid.size / base_flops,
        param_fraction=plan.param_bytes_per_device / plan.total_param_bytes,
        ideal_fraction=1 / (grid.x * grid.y * grid.z),
        max_err=max(errors),
        warnings=len(plan.warnings),
    )


def idiom_table(grids=IDIOM_GRIDS) -> str:
    """Markdown: traced redundancy (``pm.report().compute``) of tests/idiom_cases.py's models.

    No compilation. A cell names the plan's warnings when there are any.
    """
    import axonn_jax
    from axonn_jax import Grid

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import idiom_cases

    lines = ["| model | " + " | ".join(f"`{g}`" for g in grids) + " |", "|---|" + "---|" * len(grids)]
    for name, (model, args, kwargs) in idiom_cases.idioms().items():
        cells = []
        for grid in grids:
            pm = axonn_jax.partition(model, Grid.parse(grid), *args, **kwargs)
            warned = f" ({len(pm.plan.warnings)} warnings)" if pm.plan.warnings else ""
            cells.append(f"{pm.report().compute.redundancy:.3f}{warned}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    lines = ["| model | grid | redundancy | param fraction (ideal) | max rel. error | warnings |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.model} | `{r.grid}` | {r.redundancy:.2f} | {r.param_fraction:.3f} "
                     f"({r.ideal_fraction:.3f}) | {r.max_err:.1e} | {r.warnings} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Run the table (``benchmarks/run.py`` calls this); returns ``{"rows", "table"}``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hf_zoo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(hf_zoo.FAMILIES))
    parser.add_argument("--grids", default=";".join(GRIDS), help="';'-separated grids")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="every dropout probability of the configs; > 0: train mode")
    parser.add_argument("--idioms", action="store_true",
                        help="instead: the traced redundancy of tests/idiom_cases.py's models")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead: the source lines whose work is repeated, per model × grid")
    parser.add_argument("--pipeline-loss", action="store_true",
                        help="instead: the repo GPT's whole-step redundancy on pipeline grids, before/after "
                             "planning the loss with the last stage (--grids: pipeline grids)")
    parser.add_argument("--planned-loss", action="store_true",
                        help="instead: the same on one mesh (default grids x=4,data=2 and x=2,y=2,z=2)")
    ns = parser.parse_args(argv)
    if ns.pipeline_loss or ns.planned_loss:
        from axonn_jax.models import GPT, GPTConfig, next_token_loss

        entries = {}
        for vocab in (96, 1024):  # the tests' vocabulary, and one where the logits weigh more
            config = GPTConfig(vocab_size=vocab, num_layers=4, hidden=32, num_heads=4, max_seq_len=16)
            tokens = np.random.default_rng(0).integers(0, vocab, size=(8, 16)).astype(np.int32)
            entries[f"gpt vocab {vocab}"] = (GPT(config), (tokens,), next_token_loss)
        default = PIPELINE_GRIDS if ns.pipeline_loss else LOSS_GRIDS
        grids = default if ns.grids == ";".join(GRIDS) else ns.grids.split(";")
        text, loss_rows = loss_table(entries, grids)
        print(text)
        return {"rows": [], "loss_rows": loss_rows, "table": text}
    if ns.idioms:
        text = idiom_table()
        print(text)
        return {"rows": [], "table": text}
    rows = []
    for name in ns.models.split(","):
        entry = hf_zoo.build(name, dropout=ns.dropout)
        for grid in ns.grids.split(";"):
            if ns.breakdown:
                from axonn_jax import Grid

                report, _ = traced_compute(entry.model, entry.args, entry.loss, Grid.parse(grid),
                                           entry.kwargs)  # fmt: skip
                print(f"{name} {grid} (traced, loss included): {report}")
                continue
            row = measure(name, entry.model, entry.args, entry.loss, grid, entry.kwargs)
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    if rows:
        print(table(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return {"rows": [dataclasses.asdict(r) for r in rows], "table": table(rows) if rows else ""}


if __name__ == "__main__":
    main()
