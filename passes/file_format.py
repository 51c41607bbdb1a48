"""The header of planner's JSON files, checked one way: their format name and version.

Plan files (``planner/plan_file.py``) and device calibrations (``planner/calibration.py``) both
start with ``{"format": ..., "version": ...}``; a file of another kind or version is refused
with the caller's error type, saying which and how to fix it.
"""

from __future__ import annotations

from typing import Any


def check_header(
    body: Any,
    file_format: str,
    version: int,
    error: type[Exception],
    *,
    where: str,
    kind: str,
    fix: str,
) -> dict[str, Any]:
    """``body`` (a parsed JSON file, ``where``) when it is a ``kind`` of ``file_format`` at
    ``version``; else ``error`` naming what it is not and the ``fix``."""
    if not isinstance(body, dict) or body.get("format") != file_format:
        raise error(f"{where} is not a planner {kind} (no {file_format!r} format). {fix}")
    if body.get("version") != version:
        raise error(
            f"{where} has {kind} format version {body.get('version')!r}; this planner reads "
            f"version {version}. {fix}"
        )
    return body
