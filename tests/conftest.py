"""Every test's calibrations (planner/calibration.py) go to one temporary directory of the test
session, never the user's ``~/.cache/planner``; processes the tests spawn inherit it."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory: pytest.TempPathFactory):
    before = os.environ.get("PLANNER_CACHE_DIR")
    os.environ["PLANNER_CACHE_DIR"] = str(tmp_path_factory.mktemp("planner-cache"))
    yield
    if before is None:
        os.environ.pop("PLANNER_CACHE_DIR", None)
    else:
        os.environ["PLANNER_CACHE_DIR"] = before
