"""The benchmark runner and the GSPMD comparison (benchmarks/).

Checks the hand-written GSPMD specs against their definitions, the HLO
collective summary against the ring formula, the comparison's numbers against
what they must be by construction (step-1 losses equal the single-device loss
to rtol 1e-5, replicated parameters cost their full size per device, FSDP
1/8 of it, pure data parallelism all-reduces every gradient), and the runner's
handling of absent, failing and hanging benchmarks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gspmd_compare  # noqa: E402
import run  # noqa: E402
from gspmd_specs import fsdp_specs, megatron_specs  # noqa: E402
from sections import FORMATTERS  # noqa: E402


def _gpt(**overrides):
    import jax
    import jax.numpy as jnp

    from axonn_jax.models import GPT, GPTConfig

    options = dict(vocab_size=64, num_layers=1, hidden=64, num_heads=8, max_seq_len=16)
    options.update(overrides)
    model = GPT(GPTConfig(**options))
    tokens = jnp.zeros((8, 16), jnp.int32)
    return model, jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def test_megatron_specs_split_column_and_row_parallel_layers():
    from jax.sharding import PartitionSpec as P

    _, params = _gpt()
    specs = megatron_specs(params, "tp", 8)
    block = specs["block_0"]
    for name in ("query", "key", "value"):  # kernel [hidden, heads, head_dim]
        assert block["attn"][name]["kernel"] == P(None, "tp", None)
        assert block["attn"][name]["bias"] == P("tp", None)
    assert block["attn"]["out"]["kernel"] == P("tp", None, None)  # [heads, head_dim, hidden]
    assert block["attn"]["out"]["bias"] == P()
    assert block["mlp"]["fc_in"]["kernel"] == P(None, "tp")
    assert block["mlp"]["fc_in"]["bias"] == P("tp")
    assert block["mlp"]["fc_out"]["kernel"] == P("tp", None)
    assert block["mlp"]["fc_out"]["bias"] == P()
    assert specs["embed"]["embedding"] == P("tp", None)
    assert specs["pos_embed"] == P()
    assert block["norm_attn"]["scale"] == P()


def test_megatron_specs_name_the_parameter_that_does_not_divide():
    _, params = _gpt(num_heads=4, hidden=64)
    with pytest.raises(ValueError, match=r"'block_0/attn/\w+/(kernel|bias)' of shape \((64, )?4, 16\).*'tp' of size 8"):
        megatron_specs(params, "tp", 8)


def test_fsdp_specs_split_the_largest_divisible_dim():
    import jax
    from jax.sharding import PartitionSpec as P

    _, params = _gpt(vocab_size=60)  # the embedding's vocab dim (60) does not divide by 8
    specs = fsdp_specs(params, "fsdp", 8)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    assert len(spec_leaves) == len(jax.tree.leaves(params))
    for leaf, spec in zip(jax.tree.leaves(params), spec_leaves):
        split = [d for d, axis in enumerate(spec) if axis is not None]
        divisible = [d for d in range(leaf.ndim) if leaf.shape[d] % 8 == 0]
        assert len(split) == (1 if divisible else 0)
        if divisible:
            assert leaf.shape[split[0]] == max(leaf.shape[d] for d in divisible)
    assert specs["embed"]["embedding"] == P(None, "fsdp")  # [60, 64]: the hidden dim


def test_collective_summary_counts_ring_bytes_of_a_compiled_psum():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("d",))
    f = jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P())
    text = jax.jit(f).lower(jnp.ones((8 * 16,), jnp.float32)).compile().as_text()
    summary = gspmd_compare.collective_summary(text)
    assert summary["all-reduce"]["count"] == 1
    assert summary["all-reduce"]["wire_bytes"] == pytest.approx(2 * 7 / 8 * 16 * 4)
    assert sum(v["count"] for k, v in summary.items() if k != "all-reduce") == 0


@pytest.mark.slow
def test_gspmd_compare_numbers_hold_by_construction():
    args = gspmd_compare.parse_args(["--layers", "1", "--hidden", "64", "--heads", "8", "--seq", "16",
                                     "--batch", "8", "--vocab", "64", "--rounds", "1",
                                     "--per-round", "1", "--grids", "x=2,y=2,z=2",
                                     "--megatron", "8x1"])  # fmt: skip
    result = gspmd_compare.measure(args)
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {gspmd_compare.BASELINE, "axonn x=2,y=2,z=2",
                         "GSPMD Megatron tp=8,dp=1", "GSPMD FSDP fsdp=8"}  # fmt: skip
    full = result["params"] * 4
    base = rows[gspmd_compare.BASELINE]
    assert base["memory"]["params"] == full  # replicated
    assert rows["GSPMD FSDP fsdp=8"]["memory"]["params"] * 8 == full  # every dim divides by 8
    assert rows["GSPMD FSDP fsdp=8"]["memory"]["opt_state"] >= 2 * full / 8  # mu, nu sharded too
    # pure data parallelism: every gradient all-reduced over 8 devices, nothing gathered
    assert base["collectives"]["all-reduce"]["wire_bytes"] >= 2 * 7 / 8 * full
    assert base["collectives"]["all-gather"]["count"] == 0
    assert rows["axonn x=2,y=2,z=2"]["memory"]["params"] < full / 4
    # 1D tensor parallelism with a replicated batch all-reduces activations, gathers no weights
    assert rows["GSPMD Megatron tp=8,dp=1"]["collectives"]["all-gather"]["count"] == 0
    assert rows["GSPMD Megatron tp=8,dp=1"]["memory"]["params"] < full / 4
    assert base["step_ratio"] == 1.0
    for r in result["rows"]:
        assert r["loss_rel_err"] <= gspmd_compare.LOSS_RTOL
        assert r["name"] in result["table"]
    summary = FORMATTERS["gspmd_compare"][0](result)
    assert any("best axonn_jax grid (x=2,y=2,z=2)" in measure for measure, _ in summary)


def test_runner_reports_absent_failing_and_hanging_benchmarks(tmp_path):
    absent = run.run_benchmark(run.Benchmark("no_such_benchmark", "absent"), [], tmp_path)
    assert absent.result is None and "absent" in absent.reason

    code, tail = run.run_child([sys.executable, "-c", "raise ValueError('broken on purpose')"],
                               run.child_env(1), 60, "t")  # fmt: skip
    assert code == 1 and "broken on purpose" in run._failure(tail)
    code, _ = run.run_child([sys.executable, "-c", "import time; time.sleep(60)"],
                            run.child_env(1), 1, "t")  # fmt: skip
    assert code is None

    failed = run.Outcome(run.BENCHMARKS[0], ["--steps", "1"], reason="failed (exit 1): boom")
    text = run.markdown([failed], [], run.environment("run.py"))
    assert f"| {run.BENCHMARKS[0].name} | {run.BENCHMARKS[0].title} | not run: failed (exit 1): boom |" in text


def test_results_render_again_from_results_json(tmp_path):
    result = {"ratio": 1.02, "plain_s": 0.01, "axonn_s": 0.0102, "steps": 3, "params": 10}
    outcomes = [run.Outcome(run.BENCHMARKS[0], ["--steps", "3"], result=result, seconds=4.0),
                run.Outcome(run.BENCHMARKS[1], [], reason="timed out after 1 s")]  # fmt: skip
    text = run.save(outcomes, run.environment("run.py"), tmp_path)
    assert "| partition_overhead | train step on grid all-1, axonn_jax / plain jax.jit | 1.020 " in text
    assert (tmp_path / "results.md").read_text() == text
    again, env = run.load(tmp_path)
    assert run.markdown(again, [], env) == text


def test_child_env_sets_device_count_once(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3 --xla_dump_to=x")
    env = run.child_env(8)
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=x", "--xla_force_host_platform_device_count=8"]
    assert env["JAX_PLATFORMS"] == "cpu"


@pytest.mark.mpi
def test_pipeline_hop_runs_both_methods_under_mpiexec():
    import pipeline_hop

    r = pipeline_hop.main(["--sizes", "4K,64K", "--rounds", "2", "--trips", "3"])
    assert [x["bytes"] for x in r["results"]] == [4096, 65536]
    for x in r["results"]:
        assert x["trips"] == 6 and x["raw_s"] > 0 and x["transport_s"] > 0
        assert x["ratio"] == pytest.approx(x["transport_s"] / x["raw_s"])
    assert "| 64 KiB |" in r["table"]
    summary = FORMATTERS["pipeline_hop"][0](r)
    assert summary[0][0].startswith("pipeline hop of 4 KiB")
    assert r["table"] in FORMATTERS["pipeline_hop"][1](r)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_mpi_step_compares_one_process_and_mpiexec():
    """The three configurations run; the in-process one matches the one-process losses bit
    for bit (the same collectives), gloo within its reordered sums."""
    import mpi_step

    r = mpi_step.main(["--rounds", "1", "--steps", "2", "--warmup", "1", "--layers", "2",
                       "--hidden", "64"])  # fmt: skip
    one, local, gloo = r["configs"]
    assert (one["collectives"], local["collectives"], gloo["collectives"]) == (
        "in-process (one process)", "local", "gloo")
    assert one["ratio"] == 1.0 and local["ratio"] > 0 and gloo["ratio"] > 0
    assert local["loss_diff"] == 0.0 and gloo["loss_diff"] < 1e-5
    assert "| mpiexec -n 2 | local |" in r["table"]
    summary = FORMATTERS["mpi_step"][0](r)
    assert len(summary) == 2 and summary[0][0].startswith("`pipeline=2,x=2,z=2` step under mpiexec -n 2")


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_call_agreement_times_a_pipelined_step_with_and_without_it():
    """Both configurations run the step with the agreement and with it patched out; the
    summary has one ratio for each."""
    import call_agreement

    r = call_agreement.main(["--blocks", "1", "--steps", "2"])
    assert [c["label"] for c in r["configs"]] == ["one process", "mpiexec -n 2"]
    assert all(c["on_s"] > 0 and c["off_s"] > 0 and c["ratio"] > 0 for c in r["configs"])
    assert len(FORMATTERS["call_agreement"][0](r)) == 2 and "| mpiexec -n 2 |" in r["table"]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_pipeline_scan_compares_scan_and_unrolled_on_a_pipeline_and_one_device():
    import pipeline_scan

    r = pipeline_scan.main(["--rounds", "1", "--steps", "2", "--warmup", "1", "--layers", "2", "--hidden", "64"])
    assert [row["where"] for row in r["rows"]] == ["pipeline=2, mpiexec -n 2", "one device, no pipeline"]
    assert all(row["ratio"] > 0 and len(row["ratios"]) == 1 for row in r["rows"])
    summary = FORMATTERS["pipeline_scan"][0](r)
    assert len(summary) == 2 and "| pipeline=2, mpiexec -n 2 |" in r["table"]


def test_gpu_mfu_skips_without_a_gpu():
    import gpu_mfu

    assert "no GPU here" in gpu_mfu.main([])["skipped"]


@pytest.mark.slow
def test_gpu_mfu_on_cpu_counts_flops_like_xla():
    import gpu_mfu

    r = gpu_mfu.main(["--allow-cpu", "--layers", "1", "--hidden", "64", "--heads", "4", "--seq", "16",
                      "--batch", "2", "--vocab", "64", "--steps", "1", "--dtype", "float32",
                      "--peak-tflops", "1"])  # fmt: skip
    # XLA also counts softmax, norms and the optimizer: a little above the matmul count
    for name in ("axonn", "plain"):
        assert 1.0 <= r[name]["xla_flops"] / r["model_flops"] <= 1.3, (name, r)
    assert r["axonn"]["mfu"] > 0 and r["ratio"] > 0


def test_jsonable_makes_results_json_safe():
    import json

    import numpy as np

    value = {("x", 2): np.float32(1.5), "t": (1, float("nan")), "o": object}
    out = run.jsonable(value)
    assert json.loads(json.dumps(out)) == {"('x', 2)": 1.5, "t": [1, None], "o": str(object)}


def test_pipeline_async_benchmark_runs_and_reports(tmp_path):
    """Smoke run (timings are the benchmark's business, not a test's): its own 2-device
    process, async and serial results equal bit for bit (checked inside), the summary row."""
    bench = next(b for b in run.BENCHMARKS if b.name == "pipeline_async")
    outcome = run.run_benchmark(bench, ["--rounds", "1", "--layers", "4", "--rows", "8",
                                        "--microbatches", "4"], tmp_path)  # fmt: skip
    assert outcome.result is not None, outcome.reason
    r = outcome.result
    assert r["serial_overlap_s"] == 0.0 and r["overlap_s"] > 0.0
    measure, value = FORMATTERS["pipeline_async"][0](r)[0]
    assert "asynchronous" in measure and value.startswith(f"{r['speedup']:.2f}×")
    assert "| asynchronous |" in FORMATTERS["pipeline_async"][1](r)


def test_merge_replaces_the_rerun_benchmark_and_says_so(tmp_path):
    first = [run.Outcome(run.BENCHMARKS[0], [], result={"ratio": 1.5, "plain_s": 0.01, "axonn_s": 0.015,
                                                        "steps": 3, "params": 10}),
             run.Outcome(run.BENCHMARKS[1], [], reason="timed out after 1 s")]  # fmt: skip
    run.save(first, run.environment("run.py"), tmp_path)
    again = run.Outcome(run.BENCHMARKS[0], ["--steps", "3"], result=dict(first[0].result, ratio=1.25))
    outcomes, env = run.merged(tmp_path, [again], run.environment("run.py --only x --merge"))
    assert [o.bench.name for o in outcomes] == [run.BENCHMARKS[0].name, run.BENCHMARKS[1].name]
    assert outcomes[0].result["ratio"] == 1.25 and outcomes[1].reason == "timed out after 1 s"
    text = run.markdown(outcomes, [], env)
    assert f"Since then: {run.BENCHMARKS[0].name} re-run by `run.py --only x --merge`" in text
    assert "| 1.250 " in text and "| 1.500 " not in text


def test_pipeline_zero_bubble_benchmark_runs_and_reports(tmp_path):
    """Smoke run: its own 2-device process; message, zb and zb-h1 give the same loss and
    gradients (checked inside); the summary row and table."""
    bench = next(b for b in run.BENCHMARKS if b.name == "pipeline_zero_bubble")
    outcome = run.run_benchmark(bench, ["--rounds", "1", "--layers", "4", "--rows", "8",
                                        "--microbatches", "4"], tmp_path)  # fmt: skip
    assert outcome.result is not None, outcome.reason
    r = outcome.result
    assert r["speedup"]["message"] == 1.0 and r["speedup"]["zb"] > 0
    measure, value = FORMATTERS["pipeline_zero_bubble"][0](r)[0]
    assert "zero-bubble" in measure and value.startswith(f"{r['speedup']['zb']:.2f}×")
    assert "| zb-h1 |" in FORMATTERS["pipeline_zero_bubble"][1](r)


def test_pipeline_bubble_reports_the_v_placement_apart():
    """pipeline_bubble's summary rows and table key runs by virtual and placement: the V-shaped
    runs get rows of their own, not mixed with the interleaved ones (synthetic results)."""
    import pipeline_bubble

    results = [{"mode": "uniform", "m": 16, "v": v, "placement": placement, "schedule": s,
                "idle_mean": idle + (0.01 if s == "zb" else 0.0), "theory": 0.086, "theory_v1": 0.158,
                "floor": 0.045, "w_share": {}}
               for v, placement, idle in ((2, "interleaved", 0.1), (2, "v", 0.2))
               for s in ("message", "zb")]  # fmt: skip
    rows = dict(FORMATTERS["pipeline_bubble"][0]({"results": results}))
    assert [v for k, v in rows.items() if "V-shaped" in k] == ["0.20 (0.09; 0.16)", "0.21 (0.04)"]
    assert [v for k, v in rows.items() if "V-shaped" not in k] == ["0.10 (0.09; 0.16)", "0.11 (0.04)"]
    text = pipeline_bubble.table(results, 4)
    assert "| uniform | 2 | 16 | 0.100 | 0.110 |" in text and "| uniform | 2 V | 16 | 0.200 | 0.210 |" in text
    # ZB-V runs on the V only: the interleaved row shows no value in its column
    zb_v = dict(results[-1], schedule="zb-v", idle_mean=0.05)
    text = pipeline_bubble.table(results + [zb_v], 4)
    assert "| uniform | 2 | 16 | 0.100 | 0.110 | — |" in text
    assert "| uniform | 2 V | 16 | 0.200 | 0.210 | 0.050 |" in text and "| ZB-V |" in text


def test_a_benchmark_runs_its_script_under_its_own_name():
    """Two sizes of one comparison: ``gspmd_compare_512`` runs ``gspmd_compare.py`` and reads with
    its formatters; the summary names the size."""
    bench = next(b for b in run.BENCHMARKS if b.name == "gspmd_compare_512")
    assert bench.module == "gspmd_compare" and (BENCH / f"{bench.module}.py").exists()
    assert run.Outcome(bench, list(bench.args)).command.startswith(".venv/bin/python benchmarks/gspmd_compare.py ")
    assert all((BENCH / f"{b.module}.py").exists() for b in run.BENCHMARKS)


def test_the_planned_loss_table_counts_the_whole_step_before_and_after():
    """``redundancy.py --planned-loss`` on one mesh: the loss planned with the model repeats less
    work than the loss after the gathered logits (the vocabulary-sized softmax is split), and
    the summary reports both."""
    import redundancy

    result = redundancy.main(["--planned-loss", "--grids", "x=4,data=2"])
    rows = result["loss_rows"]
    assert [(r["model"], r["grid"]) for r in rows] == [("gpt vocab 96", "x=4,data=2"),
                                                      ("gpt vocab 1024", "x=4,data=2")]  # fmt: skip
    assert all(1.0 <= r["planned"] < r["gathered"] for r in rows), rows
    assert rows[1]["planned"] <= 1.03, rows  # issue 27's bound, loss included
    (label, value), _ = FORMATTERS["redundancy"][0](result)
    assert "gpt vocab 96" in label and f"{rows[0]['planned']:.3f} ({rows[0]['gathered']:.3f}) x=4,data=2" == value


def test_grid_prediction_ranks_by_the_median_round_best_and_reports_ties():
    """A round's figure is its best step; the measurement the median of those; the fastest
    share resamples whole rounds: a grid faster in every round wins all resamples, two grids
    that trade places round by round split them."""
    import grid_prediction

    samples = {"a": [[1.0, 5.0], [1.2], [1.0]], "b": [[3.0], [1.3], [3.0]]}
    assert grid_prediction.round_medians(samples) == {"a": 1.0, "b": 3.0}
    assert grid_prediction.fastest_shares(samples, resamples=200) == {"a": 1.0, "b": 0.0}
    tied = grid_prediction.fastest_shares({"a": [[1.0], [2.0]] * 4, "b": [[2.0], [1.0]] * 4}, resamples=400)
    assert sum(tied.values()) == 1.0 and min(tied.values()) >= grid_prediction.TIE_SHARE, tied


def test_grid_prediction_pools_processes_and_resamples_them_first():
    """``--runs``: a grid fastest in every round of one process but slowest in every round of
    another is not the sure winner the rounds of either process alone would make it."""
    import grid_prediction

    first = {"a": [[1.0]] * 6, "b": [[1.1]] * 6}
    second = {"a": [[1.3]] * 6, "b": [[1.2]] * 6}
    assert grid_prediction.fastest_shares(first, resamples=200) == {"a": 1.0, "b": 0.0}
    assert grid_prediction.round_medians([first, second]) == {"a": 1.15, "b": 1.15}
    shares = grid_prediction.fastest_shares([first, second], resamples=400)
    assert min(shares.values()) >= grid_prediction.TIE_SHARE, shares
    assert grid_prediction.fastest_shares([first, first], resamples=200) == {"a": 1.0, "b": 0.0}


def test_grid_prediction_summary_gives_the_predicted_best_time_against_the_best():
    m = {"grids": 3, "spearman": 0.5, "best_rank": 2, "predicted_best": "(8,1,1,1)", "predicted_best_share": 0.3,
         "tied": ["(4,2,1,1)", "(8,1,1,1)"], "runs": 3,
         "measured_ms": {"(4,2,1,1)": 20.0, "(8,1,1,1)": 21.0, "(1,1,1,8)": 40.0}}  # fmt: skip
    ((label, value),) = FORMATTERS["grid_prediction"][0]({"models": {"mlp": m}})
    assert label.startswith("grid choice, mlp") and value == (
        "0.50 (predicted best is measured #2, 1.05× the best's time, fastest in 30% of resamples, tied: 2 grids)")


def test_grid_prediction_summary_gives_the_timed_pick_beside_the_compiled_one():
    """A run with the planner's trial: a row for the compiled pick and one for the timed pick,
    each with its measured rank and its time against the measured best's."""
    m = {"grids": 3, "spearman": 0.5, "spearman_compiled": 0.9, "best_rank": 2, "pick": "(8,1,1,1)",
         "predicted_best": "(8,1,1,1)", "predicted_best_share": 0.3, "tied": ["(4,2,1,1)", "(8,1,1,1)"],
         "check": 3, "trial_pick": "(4,2,1,1)", "trial_pick_rank": 1, "trial_pick_share": 0.7, "trial_steps": 10,
         "measured_ms": {"(4,2,1,1)": 20.0, "(8,1,1,1)": 21.0, "(1,1,1,8)": 40.0}}  # fmt: skip
    (_, compiled), (label, timed) = FORMATTERS["grid_prediction"][0]({"models": {"mlp": m}})
    assert compiled.startswith("#2 (1.05× the best's time, fastest in 30% of resamples")
    assert label.startswith("grid choice, mlp: the planner's timed pick (the same 3, each run 10 steps")
    assert timed == "#1 (1.00× the best's time, fastest in 70% of resamples)"
    # the check's near ties (plan --check --within): named in both labels
    wider = {**m, "checked": ["(8,1,1,1)", "(4,2,1,1)", "(2,4,1,1)", "(1,1,1,8)"]}
    (label, _), (timed_label, _) = FORMATTERS["grid_prediction"][0]({"models": {"mlp": wider}})
    assert "the planner's pick (analytical top 3 and 1 near tie reordered by compiled step time)" in label
    assert "timed pick (the same 4, each run 10 steps" in timed_label
