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


def _summary_rows(text: str) -> list[str]:
    start = text.index("| benchmark | measure | result |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_headline_figures_are_those_of_the_latest_run():
    results = (ROOT / "benchmarks" / "results" / "results.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert _summary_rows(readme) == _summary_rows(results)
    finished = re.search(r"finished (\d{4}-\d\d-\d\d \d\d:\d\d UTC)", results).group(1)
    assert finished in readme
    # the per-topic docs quote the same run
    spearman = re.search(r"Spearman rank correlation: ([\d.]+)\*\*", results).group(1)
    assert f"Spearman rank correlation: {spearman}**" in (ROOT / "docs" / "planner.md").read_text()
    offload = re.search(r"\| bf16, offload, update on host \|[^\n]*", results).group(0)
    memory = (ROOT / "docs" / "memory.md").read_text()
    cells = [c.strip() for c in offload.split("|")[2:-1]]
    doc_row = re.search(r"\| bf16, offload, update on host \|[^\n]*", memory).group(0)
    assert [c.strip(" *") for c in doc_row.split("|")[2:-1]] == cells


def _table_after(text: str, heading: str) -> list[str]:
    """The rows of the first markdown table after ``heading``."""
    start = text.index(heading)
    lines = text[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_stage_balance_table_is_that_of_the_latest_run():
    results = (ROOT / "benchmarks" / "results" / "results.md").read_text()
    pipeline = (ROOT / "docs" / "pipeline.md").read_text()
    want = _table_after(results, "## Pipeline stage balance by model kind")
    assert len(want) > 2 and _table_after(pipeline, "**Stage balance by model kind**") == want
