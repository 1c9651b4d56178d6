"""ARCHITECTURE.md's map is the rule for the rooms of the code: every package folder under
``kvtier/`` is a room in it, and the imports between rooms and of vLLM and torch are the
ones its table allows. A module added to an existing room changes nothing here; a new
room, or a new arrow between rooms, is a decision the map has to state first."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from test_import_graph import import_graph

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- rooms: read by tests/test_architecture_layout.py -->"
HEAVY = ("vllm", "torch")


@dataclass(frozen=True)
class Room:
    """One row of the table: a folder, the rooms it may import, and whether its modules
    may import vLLM and torch at module level."""

    name: str
    imports: frozenset[str]
    vllm: bool
    torch: bool


def _doc() -> str:
    return (ROOT / "ARCHITECTURE.md").read_text()


def parse_rooms(text: str) -> dict[str, Room]:
    """The table right after MARKER: ``| room | may import | vLLM | torch |``."""
    assert MARKER in text, f"ARCHITECTURE.md has no {MARKER}"
    lines = text.split(MARKER, 1)[1].strip().splitlines()
    rows: dict[str, Room] = {}
    for line in lines[2:]:  # header, rule
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"a rooms row needs 4 cells: {line!r}"
        name, deps, vllm, torch = cells
        assert vllm in ("yes", "no") and torch in ("yes", "no"), line
        allowed = frozenset(d.strip() for d in deps.split(",") if d.strip() not in ("", "-"))
        assert name not in rows, f"room {name} listed twice"
        rows[name] = Room(name, allowed, vllm == "yes", torch == "yes")
    assert rows, "the rooms table is empty"
    return rows


def real_rooms() -> list[str]:
    """Every package folder under kvtier/ (itself included), as ``kvtier/host``."""
    return sorted(
        p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "kvtier").rglob("__init__.py")
    )


def room_of(module: str, rooms: Iterable[str]) -> str:
    """The innermost room holding ``module`` (``kvtier.objects.tiers.s3`` ->
    ``kvtier/objects/tiers``; a package is in its own room)."""
    path = module.replace(".", "/")
    best = ""
    for room in rooms:
        if (path == room or path.startswith(room + "/")) and len(room) > len(best):
            best = room
    assert best, f"{module} is in no room"
    return best


def forbidden_arrows(graph: dict[str, set[str]], rooms: dict[str, Room]) -> list[str]:
    """Each import from one room into another that the first room's row does not list."""
    out = []
    for mod, deps in sorted(graph.items()):
        src = room_of(mod, rooms)
        for dep in sorted(deps):
            dst = room_of(dep, rooms)
            if dst != src and dst not in rooms[src].imports:
                out.append(f"{mod} ({src}) imports {dep} ({dst})")
    return out


def module_level_imports(source: str) -> Iterator[str]:
    """Top-level package names a module imports when it is imported: its body, ``if`` /
    ``try`` / ``with`` blocks, but not functions, classes' methods or
    ``if TYPE_CHECKING``."""

    def walk(body: list[ast.stmt]) -> Iterator[str]:
        for node in body:
            if isinstance(node, ast.Import):
                yield from (a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if not node.level and node.module:
                    yield node.module.split(".")[0]
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                    yield from walk(node.body)
                yield from walk(node.orelse)
            elif isinstance(node, ast.Try):
                yield from walk(node.body)
                for handler in node.handlers:
                    yield from walk(handler.body)
                yield from walk(node.orelse)
                yield from walk(node.finalbody)
            elif isinstance(node, ast.With):
                yield from walk(node.body)
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body)  # a class body runs at import

    return walk(ast.parse(source).body)


def forbidden_heavy(sources: dict[str, str], rooms: dict[str, Room]) -> list[str]:
    """Each module-level import of vLLM or torch in a room whose row says no."""
    out = []
    for mod, source in sorted(sources.items()):
        room = rooms[room_of(mod, rooms)]
        for name in sorted(set(module_level_imports(source)) & set(HEAVY)):
            if not getattr(room, name):
                out.append(f"{mod} ({room.name}) imports {name} at module level")
    return out


def _sources() -> dict[str, str]:
    out = {}
    for path in sorted((ROOT / "kvtier").rglob("*.py")):
        parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
        out[".".join(parts)] = path.read_text()
    return out


# ----------------------------------------------------------------------- the checks


def test_every_package_folder_is_a_room_of_the_map() -> None:
    """A room in the code the map lacks, or a row for a room that is gone, fails; each room
    is drawn in the picture too (its folder's last name with a slash)."""
    text = _doc()
    rooms = parse_rooms(text)
    assert sorted(rooms) == real_rooms(), (
        f"rooms in kvtier/: {real_rooms()}, in ARCHITECTURE.md's table: {sorted(rooms)}"
    )
    picture = re.search(r"## Map\n+```\n(.*?)```", text, re.S)
    assert picture, "ARCHITECTURE.md has no ## Map picture"
    undrawn = [r for r in rooms if r.split("/")[-1] + "/" not in picture.group(1)]
    assert not undrawn, f"the map's picture does not draw {undrawn}"
    unknown = sorted({d for r in rooms.values() for d in r.imports} - set(rooms))
    assert not unknown, f"the table allows imports of rooms that do not exist: {unknown}"


def test_imports_between_rooms_are_the_arrows_the_map_allows() -> None:
    bad = forbidden_arrows(import_graph(), parse_rooms(_doc()))
    assert not bad, "imports the rooms table of ARCHITECTURE.md does not allow:\n" + "\n".join(bad)


def test_vllm_and_torch_only_where_the_map_allows_them() -> None:
    """The core never imports vLLM; sizing/ and cli/ import neither at module level (so
    `kvtier size` starts in well under a second); connectors/ and its scheduler side are
    the vLLM rooms (its worker side imports torch only)."""
    rooms = parse_rooms(_doc())
    assert sorted(r.name for r in rooms.values() if r.vllm) == [
        "kvtier/connectors",
        "kvtier/connectors/scheduler",
    ]
    bad = forbidden_heavy(_sources(), rooms)
    assert not bad, "module-level imports the rooms table does not allow:\n" + "\n".join(bad)


def test_the_document_names_no_module_that_is_gone() -> None:
    """A module ARCHITECTURE.md names (``x.py`` or ``room/x.py``) that no longer exists
    (renamed, merged, a deleted experiment) is a stale map."""
    existing = {
        p.relative_to(ROOT).as_posix()
        for top in ("kvtier", "bench", "tests")
        for p in (ROOT / top).rglob("*.py")
    }
    gone = sorted(
        {
            name
            for name in re.findall(r"[\w/]*\w\.py\b", _doc())
            if not any(e == name or e.endswith("/" + name) for e in existing)
        }
    )
    assert not gone, f"ARCHITECTURE.md names modules that do not exist: {gone}"


# ----------------------------------------------------- the checks can fail (self-checks)

FAKE_TABLE = f"""{MARKER}
| room | may import | vLLM | torch |
|---|---|---|---|
| kvtier | - | no | no |
| kvtier/host | kvtier | no | yes |
| kvtier/objects | kvtier, kvtier/objects/tiers | no | no |
| kvtier/objects/tiers | kvtier | no | no |
| kvtier/connectors | kvtier, kvtier/host, kvtier/objects | yes | yes |

after the table
"""


def test_a_planted_arrow_fails_and_a_new_module_in_a_room_does_not() -> None:
    rooms = parse_rooms(FAKE_TABLE)
    assert rooms["kvtier/objects"].imports == {"kvtier", "kvtier/objects/tiers"}
    assert rooms["kvtier"].imports == frozenset()
    graph = {
        "kvtier.keys": set(),
        "kvtier.host.index": {"kvtier.keys"},
        "kvtier.host.brand_new": {"kvtier.host.index", "kvtier.keys"},  # added: fine
        "kvtier.objects.remote": {"kvtier.objects.tiers.s3", "kvtier.keys"},
        "kvtier.objects.tiers.s3": {"kvtier.keys"},
        "kvtier.connectors.worker": {"kvtier.host.index", "kvtier.objects.remote"},
    }
    assert forbidden_arrows(graph, rooms) == []
    graph["kvtier.host.index"].add("kvtier.objects.remote")  # host -> objects: planted
    graph["kvtier.objects.tiers.s3"].add("kvtier.objects")  # a package is its own room
    graph["kvtier.keys"].add("kvtier.connectors")  # the core reaching up
    assert forbidden_arrows(graph, rooms) == [
        "kvtier.host.index (kvtier/host) imports kvtier.objects.remote (kvtier/objects)",
        "kvtier.keys (kvtier) imports kvtier.connectors (kvtier/connectors)",
        "kvtier.objects.tiers.s3 (kvtier/objects/tiers) imports kvtier.objects (kvtier/objects)",
    ]


def test_a_planted_vllm_or_torch_import_fails() -> None:
    rooms = parse_rooms(FAKE_TABLE)
    sources = {
        "kvtier.keys": (
            "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import vllm\n"
            "def f():\n    import torch\n"
        ),  # type-only and lazy: allowed
        "kvtier.host.layout": "import torch\n",
        "kvtier.connectors.vllm": "from vllm.config import VllmConfig\n",
    }
    assert forbidden_heavy(sources, rooms) == []
    sources["kvtier.keys"] += "try:\n    import torch.cuda\nexcept ImportError:\n    pass\n"
    sources["kvtier.host.layout"] += "class A:\n    from vllm import LLM\n"
    assert forbidden_heavy(sources, rooms) == [
        "kvtier.host.layout (kvtier/host) imports vllm at module level",
        "kvtier.keys (kvtier) imports torch at module level",
    ]


def test_the_table_parser_refuses_a_malformed_row() -> None:
    for bad in (
        FAKE_TABLE.replace("| no | yes |", "| maybe | yes |", 1),
        FAKE_TABLE.replace("| kvtier | - | no | no |", "| kvtier | - | no |"),
    ):
        try:
            parse_rooms(bad)
        except AssertionError:
            continue
        raise AssertionError(f"accepted: {bad}")
