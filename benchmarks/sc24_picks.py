"""The planner's picks for the SC'24 GPT models (5B–640B) on Perlmutter and Frontier.

Model shapes are the AxoNN paper's GPT table; every model trains on
16.8M-token batches (8,192 sequences of 2,048 tokens, vocabulary 51,200) in
mixed precision. GPU counts scale with the model (weak scaling); they are this
repository's choice (see docs/planner.md). Prints a markdown table: the best
configuration per model and machine (grid, virtual stages, microbatches,
recompute, offload and where the offloaded update runs, all searched), its
predicted communication and step time, and the search time.

    .venv/bin/python benchmarks/sc24_picks.py
"""

from __future__ import annotations

import time

#: name -> (layers, hidden, heads)
MODELS = {
    "5B": (24, 4096, 32),
    "10B": (32, 5120, 40),
    "20B": (32, 7168, 56),
    "40B": (38, 9216, 72),
    "60B": (56, 9216, 72),
    "80B": (42, 12288, 96),
    "160B": (84, 12288, 96),
    "320B": (96, 16384, 128),
    "640B": (192, 16384, 128),
}
#: machine -> GPUs (GCDs on Frontier) per model, doubling with the model size
GPUS = {
    "perlmutter": dict(zip(MODELS, (64, 128, 256, 512, 1024, 1024, 2048, 4096, 4096))),
    "frontier": dict(zip(MODELS, (512, 1024, 2048, 4096, 8192, 8192, 16384, 32768, 32768))),
}
SEQ, BATCH, VOCAB = 2048, 8192, 51200


def main() -> list[dict]:
    from axonn_jax.perf import machines
    from axonn_jax.perf.spec import gpt_spec
    from axonn_jax.search import search

    rows = []
    print("| model | machine | GPUs | x | y | z | data | pipeline | virtual | microbatches | recompute "
          "| offloaded update | predicted comm s | predicted step s | GiB/GPU | search s |")  # fmt: skip
    print("|" + " --- |" * 16)
    for machine_name, counts in GPUS.items():
        machine = machines.get(machine_name)
        for name, (layers, hidden, heads) in MODELS.items():
            spec = gpt_spec(layers=layers, hidden=hidden, heads=heads, seq=SEQ, batch=BATCH,
                            vocab=VOCAB, name=f"GPT-{name}")  # fmt: skip
            t0 = time.perf_counter()
            result = search(spec, counts[name], machine, top=1)
            seconds = time.perf_counter() - t0
            if not result.ranked:
                print(f"| {name} | {machine_name} | {counts[name]} | no feasible grid "
                      f"({result.summary()}) |||||||||||||")  # fmt: skip
                continue
            p = result.ranked[0]
            g = p.grid
            row = dict(model=name, machine=machine_name, gpus=counts[name], grid=g,
                       prediction=p, search_seconds=seconds)  # fmt: skip
            rows.append(row)
            o = p.options
            print(f"| {name} | {machine_name} | {counts[name]:,} | {g.x} | {g.y} | {g.z} | "
                  f"{g.data} | {g.pipeline} | {g.virtual} | {o.microbatches} | {'yes' if o.recompute else 'no'} | "
                  f"{o.update_on if o.offload else 'no'} | {p.comm_seconds:.2f} | "
                  f"{p.step_seconds:.1f} | {p.memory.device / 2**30:.1f} | {seconds:.1f} |",
                  flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
