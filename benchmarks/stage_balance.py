"""Pipeline stage balance: each stage's share of the FLOPs, per model kind, pipeline 2 and 4.

Plans (abstract shapes: no devices, no compute) an MLP, a VGG-style CNN, a
Dense+BatchNorm+Dropout MLP in train mode, the repository's encoder-decoder
and GPT, and HuggingFace's Flax GPT-2, BERT and Llama, at the sizes such
models are trained at (bf16 activations for the transformers), and five
test-size models (:data:`SMALL`: three of the repository's, and the scanned
transformers of ``tests/control_flow_cases.py``, whose stack the plan cuts
between stages), on
``Grid(pipeline=p)``; reports each stage's share of the forward FLOPs
(``partitioner.flops.equation_flops`` over the stage's equations), the
modelled slowest stage, and the plan's notes. ``--baseline REV`` plans the
same models with the partitioner of git revision ``REV`` (in a child
process) and reports its stages by the same FLOP count ("before"); a
revision that refuses a model is reported with its error.

    .venv/bin/python benchmarks/stage_balance.py --baseline 74591ed
    .venv/bin/python benchmarks/stage_balance.py --models mlp,cnn --pipelines 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mlp", "cnn", "bn_mlp", "encdec", "gpt", "hf_gpt2", "hf_bert", "hf_llama")
#: the repository's test-size models: kernel- and transfer-bound, cut by kernel count (noted in the
#: plan); the scanned transformers of tests/control_flow_cases.py (linen nn.scan, nnx.scan)
SMALL = ("small_mlp", "small_cnn", "small_gpt", "scan_gpt", "scan_gpt_nnx")


@dataclasses.dataclass(frozen=True)
class Case:
    """A model with example inputs (one microbatch) and what it is, for the table."""

    model: object
    args: tuple
    kwargs: dict
    what: str


def _deep_mlp(batchnorm: bool):
    import flax.linen as nn

    class DeepMLP(nn.Module):
        """8 × Dense(2048) → [BatchNorm →] relu [→ Dropout(0.1)], then Dense(10)."""

        @nn.compact
        def __call__(self, x, train: bool = True):
            for _ in range(8):
                x = nn.Dense(2048)(x)
                if batchnorm:
                    x = nn.BatchNorm(use_running_average=not train)(x)
                x = nn.relu(x)
                if batchnorm:
                    x = nn.Dropout(0.1, deterministic=not train)(x)
            return nn.Dense(10)(x)

    return DeepMLP()


def _vgg():
    import flax.linen as nn

    class VGG(nn.Module):
        """VGG-style: two 3×3 convolutions + relu per width (64, 128, 256, 512), 2×2 max-pool after each pair."""

        @nn.compact
        def __call__(self, x):
            for width in (64, 128, 256, 512):
                for _ in range(2):
                    x = nn.relu(nn.Conv(width, (3, 3))(x))
                x = nn.max_pool(x, (2, 2), (2, 2))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    return VGG()


def build(name: str) -> Case:
    """The model ``name`` (one of :data:`MODELS`) with abstract example inputs."""
    import jax
    import jax.numpy as jnp

    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    if name == "small_mlp":
        from axonn_jax.models import MLP

        return Case(MLP(features=(64, 64, 64, 64, 10)), (s((8, 32), jnp.float32),), {},
                    "4 × Dense(64)+gelu, Dense(10); batch 8, fp32")  # fmt: skip
    if name == "small_cnn":
        from axonn_jax.models import CNN

        return Case(CNN(channels=(8, 16)), (s((8, 28, 28, 1), jnp.float32),), {},
                    "the repository's CNN: 2 convs (8, 16 channels), 28×28, batch 8, fp32")  # fmt: skip
    if name == "mlp":
        return Case(_deep_mlp(False), (s((64, 2048), jnp.float32),), {},
                    "8 × Dense(2048)+relu, Dense(10); batch 64, fp32")  # fmt: skip
    if name == "cnn":
        return Case(_vgg(), (s((64, 32, 32, 3), jnp.float32),), {},
                    "VGG-style, 8 convs (64…512 channels), 32×32 images, batch 64, fp32")  # fmt: skip
    if name == "bn_mlp":
        return Case(_deep_mlp(True), (s((64, 2048), jnp.float32),),
                    dict(mutable=["batch_stats"], rngs={"dropout": jax.random.key(0)}),
                    "8 × Dense(2048)+BatchNorm+relu+Dropout, Dense(10); train mode, batch 64, fp32")  # fmt: skip
    tokens = lambda b, n: s((b, n), jnp.int32)  # noqa: E731
    if name in ("scan_gpt", "scan_gpt_nnx"):
        sys.path.insert(0, str(ROOT / "tests"))
        import control_flow_cases as cf
        from flax import nnx

        model = cf.ScanGPT() if name == "scan_gpt" else cf.ScanGPTNNX(rngs=nnx.Rngs(0))
        scan = "linen nn.scan over" if name == "scan_gpt" else "nnx.scan over nnx.vmap-made"
        return Case(model, (tokens(cf.BATCH, cf.SEQ),), {},
                    f"{scan} {cf.LAYERS} stacked blocks, hidden {cf.HIDDEN}, seq {cf.SEQ}, "
                    f"batch {cf.BATCH}, fp32")  # fmt: skip
    if name == "small_gpt":
        from axonn_jax.models import GPT, GPTConfig

        config = GPTConfig(vocab_size=64, num_layers=4, hidden=32, num_heads=4, max_seq_len=16)
        return Case(GPT(config), (tokens(8, 16),), {}, "4 layers, hidden 32, seq 16, batch 8, fp32")
    if name == "encdec":
        from axonn_jax.models import EncDecConfig, EncoderDecoder

        config = EncDecConfig(vocab_size=32000, num_encoder_layers=4, num_decoder_layers=4,
                              hidden=1024, num_heads=16, max_seq_len=512, dtype=bf16)  # fmt: skip
        return Case(EncoderDecoder(config), (tokens(8, 512), tokens(8, 512)), {},
                    "4+4 layers, hidden 1024, seq 512, batch 8, bf16")  # fmt: skip
    if name == "gpt":
        from axonn_jax.models import GPT, GPTConfig

        config = GPTConfig(vocab_size=50304, num_layers=8, hidden=2048, num_heads=16,
                           max_seq_len=1024, dtype=bf16)  # fmt: skip
        return Case(GPT(config), (tokens(8, 1024),), {}, "8 layers, hidden 2048, seq 1024, batch 8, bf16")
    import transformers as hf

    if name == "hf_gpt2":
        from transformers.models.gpt2 import modeling_flax_gpt2 as m

        config = hf.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=8, n_head=12)
        return Case(m.FlaxGPT2LMHeadModule(config, dtype=bf16), (tokens(8, 1024),) * 3, {},
                    "8 layers, hidden 768, seq 1024, batch 8, bf16")  # fmt: skip
    if name == "hf_bert":
        from transformers.models.bert import modeling_flax_bert as m

        config = hf.BertConfig(num_hidden_layers=8)  # BERT-base widths
        return Case(m.FlaxBertForMaskedLMModule(config, dtype=bf16), (tokens(8, 512),) * 4 + (None,), {},
                    "8 layers, hidden 768, seq 512, batch 8, bf16")  # fmt: skip
    if name == "hf_llama":
        from transformers.models.llama import modeling_flax_llama as m

        config = hf.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                max_position_embeddings=1024)  # fmt: skip
        return Case(m.FlaxLlamaForCausalLMModule(config, dtype=bf16), (tokens(8, 1024),) * 3, {},
                    "8 layers, hidden 2048, GQA 16/4 heads, seq 1024, batch 8, bf16")  # fmt: skip
    raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS + SMALL)}")


def plan_stages(name: str, pipeline: int) -> dict:
    """Plan ``name`` on ``Grid(pipeline=pipeline)``: its stages' equation ranges, or the error."""
    import axonn_jax

    case = build(name)
    try:
        pm = axonn_jax.partition(case.model, axonn_jax.Grid(pipeline=pipeline), *case.args, **case.kwargs)
    except ValueError as e:  # "<model> on <grid>: the model has ... (pipeline × virtual). Remedy: ..."
        return {"error": "refused: " + str(e).split("): ", 1)[-1].split(" (pipeline")[0]}
    plan = pm.plan
    slowest = max((getattr(s, "compute_seconds", 0.0) + getattr(s, "transfer_seconds", 0.0))
                  for s in plan.stages)  # fmt: skip
    notes = [w for w in plan.warnings if w.startswith("pipeline stages")]
    result = {"ranges": [[s.start, s.stop] for s in plan.stages], "slowest_s": slowest, "notes": notes}
    if getattr(plan, "scan_cuts", ()):  # the ranges index the program with the scan split at the cuts
        result["shares"] = flop_shares(name, result["ranges"], pm.program.jaxpr)
    return result


def flop_shares(name: str, ranges, jaxpr=None) -> list[float]:
    """Each range's share of the model's forward FLOPs (the one per-equation count).

    ``jaxpr``: the equations the ranges index (default: the model inlined; a
    plan that cut a scan between stages indexes its program's jaxpr, where
    the scan is split at the cuts).
    """
    import numpy as np

    from axonn_jax.partitioner.flops import equation_flops
    from axonn_jax.partitioner.trace import inline_calls, trace_model

    if jaxpr is None:
        case = build(name)
        jaxpr = inline_calls(trace_model(case.model, *case.args, **case.kwargs).jaxpr).jaxpr
    flops = np.array([equation_flops(e) for e in jaxpr.eqns], dtype=np.float64)
    if ranges[-1][1] != len(flops):
        raise ValueError(f"{name}: the ranges end at {ranges[-1][1]}, the model has {len(flops)} equations")
    return [float(flops[a:b].sum() / flops.sum()) for a, b in ranges]


def _baseline(rev: str, models, pipelines) -> dict:
    """``{(model, p): plan_stages(...)}`` planned by the partitioner of git revision ``rev``."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        archive = subprocess.run(["git", "archive", rev, "axonn_jax", "partitioner", "runtime"],
                                 cwd=ROOT, capture_output=True, check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        shutil.move(str(tree / "partitioner"), str(tree / "axonn_jax" / "partitioner"))
        shutil.move(str(tree / "runtime"), str(tree / "axonn_jax" / "runtime"))
        env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                              ",".join(models), ",".join(map(str, pipelines))],
                             cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"the baseline {rev} failed: {out.stderr[-2000:]}")
        rows = json.loads(out.stdout.strip().splitlines()[-1])
    return {(r["model"], r["pipeline"]): r for r in rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS + SMALL))
    ap.add_argument("--pipelines", default="2,4")
    ap.add_argument("--baseline", default=None, help="a git revision to compare with (before)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:  # in the baseline's tree: print the stage ranges as one JSON line
        models, pipelines = a.child[0].split(","), [int(p) for p in a.child[1].split(",")]
        print(json.dumps([dict(model=m, pipeline=p, **plan_stages(m, p)) for m in models for p in pipelines]))
        return {}
    models, pipelines = a.models.split(","), [int(p) for p in a.pipelines.split(",")]
    before = _baseline(a.baseline, models, pipelines) if a.baseline else {}
    rows = []
    for m in models:
        for p in pipelines:
            after = plan_stages(m, p)
            row = {"model": m, "what": build(m).what, "pipeline": p,
                   "after": after.get("shares") or flop_shares(m, after["ranges"]), "slowest_s": after["slowest_s"],
                   "notes": after["notes"], "small": m in SMALL}  # fmt: skip
            if (m, p) in before:
                old = before[(m, p)]
                row["before"] = old["error"] if "error" in old else flop_shares(m, old["ranges"])
            rows.append(row)
            print(_line(row), flush=True)
    return {"rows": rows, "baseline": a.baseline}


def _shares(values) -> str:
    return values if isinstance(values, str) else " / ".join(f"{v:.1%}" for v in values)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def _line(row: dict) -> str:
    before = f"before {_shares(row['before'])}; " if "before" in row else ""
    return f"{row['model']} pipeline={row['pipeline']}: {before}after {_shares(row['after'])}"


def table(result: dict) -> str:
    """The markdown table of :func:`main`'s result."""
    rows = result.get("rows", [])
    head = ["| model | p | before (FLOP share per stage) | after | largest share × p | slowest stage (modelled) | plan note |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines = []
    for r in rows:
        before = _shares(r["before"]) if "before" in r else "–"
        worst = max(r["after"]) * r["pipeline"]
        note = "uneven: kernel/transfer-bound" if r["notes"] else ""
        lines.append(f"| {r['model']}: {r['what']} | {r['pipeline']} | {before} | {_shares(r['after'])} "
                     f"| {worst:.2f} | {_time(r['slowest_s'])} | {note} |")
    return "\n".join(head + lines)


if __name__ == "__main__":
    main()
