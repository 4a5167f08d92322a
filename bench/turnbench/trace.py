"""Agent traces: turns of shell commands, each followed by the model's think time.

A trace is a JSON file (``bench/traces/*.json``)::

    {"name": "mixed", "turns": [{"kind": "read", "wait_s": 6, "run": ["ls /workspace"]}, ...]}

``kind`` is a label for people (read, edit, install, server, build); ``run`` the commands
the agent executes in the sandbox, in order; ``wait_s`` how long the model thinks after
the turn (2-10 s in the shipped traces).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACES = Path(__file__).resolve().parent.parent / "traces"


@dataclass(frozen=True)
class Turn:
    kind: str
    wait_s: float
    run: tuple[str, ...]


@dataclass(frozen=True)
class Trace:
    name: str
    turns: tuple[Turn, ...]

    def kinds(self) -> list[str]:
        return [t.kind for t in self.turns]


def parse(data: dict[str, Any]) -> Trace:
    """A trace from its JSON object; ValueError names what is wrong."""
    turns = data.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ValueError("a trace needs a non-empty list \"turns\"")
    out = []
    for i, turn in enumerate(turns):
        run, wait = turn.get("run"), turn.get("wait_s")
        if not isinstance(run, list) or not all(isinstance(c, str) for c in run):
            raise ValueError(f"turn {i}: \"run\" must be a list of commands")
        if not isinstance(wait, (int, float)) or wait < 0:
            raise ValueError(f"turn {i}: \"wait_s\" must be a number >= 0")
        out.append(Turn(str(turn.get("kind", "turn")), float(wait), tuple(run)))
    return Trace(str(data.get("name", "trace")), tuple(out))


def load(name_or_path: str) -> Trace:
    """``mixed`` (a shipped trace) or a path to a JSON file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = TRACES / f"{name_or_path}.json"
    return parse(json.loads(path.read_text()))


def shortened(trace: Trace, turns: int | None, wait_scale: float = 1.0) -> Trace:
    """The first ``turns`` turns (all with None), think times scaled by ``wait_scale``."""
    kept = trace.turns[:turns] if turns else trace.turns
    return Trace(trace.name, tuple(Turn(t.kind, t.wait_s * wait_scale, t.run) for t in kept))
