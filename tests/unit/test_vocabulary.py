"""The protocol's words are written once: no checkpoint phase or reason, restore phase,
sandbox or pod phase, label or annotation appears as a string literal in operator/,
node-agent/ or common/ outside hermit_common/protocol.py and hermit_common/api.py."""

from __future__ import annotations

import ast
from pathlib import Path

from hermit_common import api, protocol

ROOT = Path(__file__).resolve().parents[2]
HOMES = {ROOT / "common" / "hermit_common" / "protocol.py",
         ROOT / "common" / "hermit_common" / "api.py"}


def _words() -> set[str]:
    words = set(protocol.CHECKPOINT_PHASES) | set(protocol.REASONS) \
        | set(protocol.RESTORE_PHASES) | set(api.SANDBOX_PHASES) \
        | {api.POD_PENDING, api.POD_RUNNING, api.POD_SUCCEEDED, api.POD_FAILED}
    for module in (protocol, api):
        words |= {value for name, value in vars(module).items()
                  if name.startswith(("LABEL_", "ANNOTATION_", "TAINT_"))
                  and isinstance(value, str)}
    return words


def _literals(path: Path) -> list[tuple[int, str]]:
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_no_protocol_word_is_retyped_outside_its_home() -> None:
    words = _words()
    found = [f"{path.relative_to(ROOT)}:{line}: {value!r}"
             for top in ("operator", "node-agent", "common")
             for path in sorted((ROOT / top).rglob("*.py")) if path not in HOMES
             for line, value in _literals(path) if value in words]
    assert found == [], "use the names in hermit_common.protocol / api:\n" + "\n".join(found)
