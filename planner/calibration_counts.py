"""How many measurements this process made, by kind: "ops" (calls timed), "scaled" (calls a
batch sweep priced from a smaller batch's), "retimed" (calls timed again after a jump),
"overheads" (the per-call and checkpoint fits), "steps" (small steps timed whole). A second
plan that needs nothing new leaves them unchanged; tests read them to see what was measured."""

from __future__ import annotations

from collections import Counter

MEASUREMENTS: Counter[str] = Counter()
