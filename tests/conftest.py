"""Every test's calibrations (planner/calibration.py) go to one temporary directory of the test
session, never the user's ``~/.cache/planner``; processes the tests spawn inherit it.

Under pytest-xdist each worker runs torch on its share of the cores: two workers on two cores
with torch's default of a thread per core oversubscribe them, and the op timings that pricing
repeats until they are steady then take several times as long."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes tests spawn


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory: pytest.TempPathFactory):
    before = os.environ.get("PLANNER_CACHE_DIR")
    os.environ["PLANNER_CACHE_DIR"] = str(tmp_path_factory.mktemp("planner-cache"))
    yield
    if before is None:
        os.environ.pop("PLANNER_CACHE_DIR", None)
    else:
        os.environ["PLANNER_CACHE_DIR"] = before
