"""The docs tell the truth: links resolve, headline figures are those of the latest benchmark run."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True)
    return [ROOT / line for line in out.stdout.splitlines()] if out.returncode == 0 else DOCS


def test_relative_links_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_no_reference_to_files_outside_the_repo():
    for path in _tracked("*.md", "*.py"):
        if path.exists() and path.name != "test_docs.py":
            assert "design.md" not in path.read_text(), f"{path.relative_to(ROOT)} cites design.md"


def _table_rows(text: str, after: str, header: str = "|") -> list[str]:
    """The rows (header and rule included) of the first markdown table after ``after``
    whose header line starts with ``header``."""
    lines = text[text.index(after):].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def _summary_rows(text: str) -> list[str]:
    return _table_rows(text, "| benchmark | measure | result |")[2:]


def test_headline_figures_are_those_of_the_latest_run():
    results = (ROOT / "benchmarks" / "results" / "results.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert _summary_rows(readme) == _summary_rows(results)
    finished = re.search(r"finished (\d{4}-\d\d-\d\d \d\d:\d\d UTC)", results).group(1)
    assert finished in readme
    # the per-topic docs quote the same run
    pick = re.search(r"\*\*The planner's pick [^*]+\*\*", results).group(0)
    assert pick in (ROOT / "docs" / "planner.md").read_text()
    offload = re.search(r"\| bf16, offload, update on host \|[^\n]*", results).group(0)
    memory = (ROOT / "docs" / "memory.md").read_text()
    cells = [c.strip() for c in offload.split("|")[2:-1]]
    doc_row = re.search(r"\| bf16, offload, update on host \|[^\n]*", memory).group(0)
    assert [c.strip(" *") for c in doc_row.split("|")[2:-1]] == cells


def _listed_modules(text: str, heading: str) -> set[str]:
    """The first-column module names of the table under ``### `heading` ``."""
    rows = _table_rows(text, f"### `{heading}`")[2:]
    return {name for row in rows for name in re.findall(r"`([^`]+\.py)`", row.split("|")[1])}


def test_architecture_lists_every_module_once_per_line():
    """docs/architecture.md has one line per module of partitioner/, runtime/ and axonn_jax/."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    for folder, heading in (("partitioner", "partitioner/"), ("runtime", "runtime/"), ("axonn_jax", "axonn_jax/")):
        modules = {str(p.relative_to(ROOT / folder)) for p in (ROOT / folder).rglob("*.py")
                   if "__pycache__" not in p.parts}  # fmt: skip
        listed = _listed_modules(text, heading)
        assert modules == listed, (f"{heading}: missing {sorted(modules - listed)}, "
                                   f"listed but absent {sorted(listed - modules)}")  # fmt: skip


def test_planner_doc_lists_every_plan_option_and_json_key(capsys):
    import json

    from axonn_jax.cli import _parser, main

    _, commands = _parser()
    flags = {o for a in commands["plan"]._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    text = " ".join((ROOT / "docs" / "planner.md").read_text().split())
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text))
    assert not missing, f"docs/planner.md omits {missing}"
    assert main(["plan", "--gpus", "8", "--machine", "perlmutter", "--layers", "2", "--hidden", "128",
                 "--heads", "4", "--seq", "64", "--batch", "16", "--vocab", "256", "--top", "1", "--json"]) == 0
    [first] = json.loads(capsys.readouterr().out)
    start = text.index("`--json` (one object per configuration: ")
    segment = text[start + len("`--json`") : text.index(")", start)]
    documented = set(re.findall(r"\w+", " ".join(re.findall(r"`([^`]*)`", segment))))
    assert documented == set(first) | set(first["bytes_per_gpu"])


def test_in_flight_figures_in_the_docs_are_the_models():
    """docs/pipeline.md and docs/planner.md quote rank 0's in-flight activations."""
    from axonn_jax.perf.memory import in_flight

    assert (in_flight(16, 4), in_flight(16, 4, virtual=2)) == (5.0, 7.0)
    for doc in ("pipeline.md", "planner.md"):
        text = " ".join((ROOT / "docs" / doc).read_text().split())
        assert "min(m, p + 1)" in text and "Σ_c min(m, p·v + 1 − c·p) / v" in text, doc
        assert re.search(r"5 (at p=4, m=16 — )?and 7 at p=4", text), doc
        assert "min(m, p)`" not in text and "up to `pipeline`" not in text, doc


def test_stage_balance_table_is_that_of_the_latest_run():
    results = (ROOT / "benchmarks" / "results" / "results.md").read_text()
    pipeline = (ROOT / "docs" / "pipeline.md").read_text()
    want = _table_rows(results, "## Pipeline stage balance by model kind", "| model |")
    assert len(want) > 2 and _table_rows(pipeline, "**Stage balance by model kind**", "| model |") == want
