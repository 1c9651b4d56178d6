"""ARCHITECTURE.md's layout names every module of the code it describes, so a newcomer
who reads it before ``ls`` meets no file it does not mention."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvtier", "kvtier/host", "kvtier/objects", "kvtier/objects/tiers",
            "kvtier/connectors", "kvtier/sizing", "kvtier/cli", "bench")


def layout_block() -> str:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    m = re.search(r"## Layout\n+```\n(.*?)```", text, re.S)
    assert m, "ARCHITECTURE.md has no ## Layout code block"
    return m.group(1)


def test_the_layout_names_every_module() -> None:
    names = set(re.findall(r"[\w]+\.py", layout_block()))
    missing = [
        f"{pkg}/{path.name}"
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).glob("*.py"))
        if path.name != "__init__.py" and path.name not in names
    ]
    assert not missing, f"ARCHITECTURE.md's layout does not name {missing}"


def test_the_layout_names_no_module_that_is_gone() -> None:
    existing = {p.name for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py")}
    gone = sorted(set(re.findall(r"[\w]+\.py", layout_block())) - existing)
    assert not gone, f"ARCHITECTURE.md's layout names modules that do not exist: {gone}"


def test_the_layout_names_every_room() -> None:
    """Each sub-package of kvtier/ (a room: host/, objects/, objects/tiers/) has its own
    line in the layout, so a module is read under the room it lives in."""
    block = layout_block()
    rooms = sorted(p.parent.relative_to(ROOT / "kvtier").as_posix()
                   for p in (ROOT / "kvtier").rglob("__init__.py") if p.parent != ROOT / "kvtier")
    missing = [r for r in rooms
               if not re.search(rf"^\s+{re.escape(r.split('/')[-1])}/ ", block, re.M)]
    assert rooms and not missing, f"ARCHITECTURE.md's layout has no line for {missing}"
