"""The docs site builds with ``mkdocs build --strict``, and every Python block in docs/ runs.

Blocks run in order, one namespace per page (sybil). A block preceded by
``<!-- skip: next "reason" -->`` is not run, and the reason says why (a GPU, a download,
several processes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unittest
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

PAGES = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))


def _parse(page: str):
    sybil = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])
    return sybil.parse(DOCS / page)


def _python_blocks(page: str) -> int:
    return (DOCS / page).read_text().count("```python")


@pytest.mark.parametrize("page", PAGES)
def test_docs_page_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # plan.json and the like land in a temporary folder
    document = _parse(page)
    ran = 0
    for example in document:
        try:
            example.evaluate()
        except unittest.SkipTest:
            continue  # a block marked not run, with its reason; the page's other blocks run
        ran += 1
    assert ran > 0 or not _python_blocks(page), f"{page}: no block ran"


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [page for page in PAGES if page not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    # mkdocs and its plugins come with the dev extra; a missing one fails here, loudly
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml")]
        + ["-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("plan", "apply_plan", "measure", "verify", "InfeasibleBudgetError"):
        assert f'id="{name}"' in api or f"{name}" in api, name
    # the theme's web fonts stay off: the site reads with no network
    assert "fonts.googleapis" not in (site / "index.html").read_text()


def test_readme_and_benchmarks_stay_short_and_about_the_project() -> None:
    readme = (ROOT / "README.md").read_text()
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert len(benchmarks.encode()) <= 40_000
    for marker in ("<!-- ci:quickstart -->", "<!-- /ci:quickstart -->", "<!-- ci:test -->"):
        assert marker in readme, marker
    diary = re.compile(r"session [0-9]+|device loan|loan ended", re.IGNORECASE)
    for name, text in (("README.md", readme), ("BENCHMARKS.md", benchmarks)):
        assert not diary.search(text), f"{name}: {diary.search(text).group(0)!r}"


def test_results_json_matches_the_benchmarks_table() -> None:
    """benchmarks/results/gpt_ref_vs_anchors.json holds the README's headline figures; each row is
    the table's row of the same run in BENCHMARKS.md."""
    results = json.loads((ROOT / "benchmarks/results/gpt_ref_vs_anchors.json").read_text())
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split("<!-- vs_anchors:start -->")[1].split("<!-- vs_anchors:end -->")[0]
    table = {
        cells[0]: cells
        for line in section.splitlines()
        if line.startswith("| ")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    for row in results["rows"]:
        cells = table[row["run"]]
        assert f"{row['measured_peak_mib']:.2f}" == cells[1], row["run"]
        assert f"{row['step_time_s']:.3f}" == cells[5], row["run"]


def test_api_reference_covers_every_export() -> None:
    import planner

    exported = set(planner._LAZY) | {
        name for name in vars(planner) if name.endswith(("Error", "Warning"))
    }
    api = (DOCS / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^::: [\w.]+\.(\w+)$", api, re.MULTILINE))
    assert exported <= documented, f"not in docs/reference/api.md: {sorted(exported - documented)}"
