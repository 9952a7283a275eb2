"""Figures the scenarios measure (throughput, delays, memory): printed at the end of the run
and, with ``KVGATE_RELIABILITY_FIGURES=<file>``, appended to that file as JSON lines.

They are reported, never compared with a clock in an assertion, except where a scenario bounds
something by construction (memory growth, a shutdown within its grace period).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIGURES_ENV = "KVGATE_RELIABILITY_FIGURES"


@dataclass
class Figures:
    rows: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def record(self, scenario: str, **values: Any) -> None:
        self.rows.append((scenario, values))
        target = os.environ.get(FIGURES_ENV)
        if target:
            with Path(target).open("a") as sink:
                sink.write(json.dumps({"scenario": scenario, **values}) + "\n")

    def lines(self) -> list[str]:
        return [
            f"{scenario}: " + ", ".join(f"{k}={_show(v)}" for k, v in values.items())
            for scenario, values in self.rows
        ]


def _show(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


MIB = 1 << 20
