"""No import cycle among kvtier's modules, lazy or not.

A cycle hidden behind an import inside a function (or under ``TYPE_CHECKING``) still
ties two modules together: neither can be read, moved or tested without the other,
and the lazy import only postpones the failure to whichever order the first caller
happens to use. This test parses every module of the package (``kvtier/``, whose
folders are its import paths), collects every import statement wherever it sits, and
fails naming the cycle if one exists.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: package name -> its folder: one tree, the import path is the folder
PACKAGES = {"kvtier": ROOT / "kvtier"}


def module_files() -> dict[str, Path]:
    """Every module's dotted name -> its file (a package's name -> its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _imported(node: ast.AST, module: str, is_pkg: bool) -> Iterator[str]:
    """The dotted names ``node`` imports (with ``from X import y``: both X and X.y)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        yield target
        for alias in node.names:
            yield f"{target}.{alias.name}"


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (module level,
    inside functions, under ``TYPE_CHECKING``). ``from pkg import name`` points at the
    submodule ``pkg.name`` when there is one, else at ``pkg`` itself."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = list(_imported(node, mod, is_pkg))
            if isinstance(node, ast.ImportFrom):
                target, subs = names[0], names[1:]
                hits = [s for s in subs if s in files]
                if target in files and len(hits) < len(subs):
                    hits.append(target)  # some names are attributes of the package itself
                edges.update(hits)
            else:
                edges.update(n for n in names if n in files)
        edges.discard(mod)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_sees_every_kind_of_import() -> None:
    """The parser finds module-level, relative, lazy and TYPE_CHECKING imports, so a
    cycle cannot hide from the test below behind any of them."""
    graph = import_graph()
    assert "kvtier.objects.codec" in graph and "kvtier.objects.tiers.redis" in graph
    assert {"kvtier.connectors.worker.side", "kvtier.cli.main", "kvtier.cli.bench"} <= set(graph)
    assert "kvtier.objects.sealing" in graph["kvtier.objects.codec"]  # module level, absolute
    assert "kvtier.host.layout" in graph["kvtier.host.transfer"]  # relative
    assert "kvtier.sizing.trace" in graph["kvtier.cli.bench_trace"]  # inside a function
    assert "kvtier.config" in graph["kvtier.objects.sealing"]  # under TYPE_CHECKING


def test_find_cycle_reports_lazy_and_long_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a2"}, "a2": set(), "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_host_and_object_rooms_do_not_import_each_other() -> None:
    """kvtier/host/ and kvtier/objects/ share only what sits at the top of kvtier/."""
    graph = import_graph()
    rooms = ("kvtier.host", "kvtier.objects")
    crossing = [
        (mod, dep)
        for mod, deps in graph.items()
        for room, other in (rooms, rooms[::-1])
        if mod == room or mod.startswith(room + ".")
        for dep in deps
        if dep == other or dep.startswith(other + ".")
    ]
    assert any(m.startswith("kvtier.host.") for m in graph)
    assert any(m.startswith("kvtier.objects.") for m in graph)
    assert not crossing, f"the host and object rooms import each other: {crossing}"


def private_imports(
    source: str, module: str, is_pkg: bool, files: dict[str, Path]
) -> list[tuple[str, str]]:
    """``(other module, name)`` for each private name (``_x``, not a dunder) that
    ``module``'s source takes from another kvtier module: ``from other import _x``
    anywhere in the file, or ``other._x`` on a name an import bound to that module."""
    found: list[tuple[str, str]] = []
    bound: dict[str, str] = {}  # local name -> the kvtier module it stands for
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target, *subs = _imported(node, module, is_pkg)
            for alias, sub in zip(node.names, subs, strict=True):
                if sub in files:  # a submodule: its attributes are checked below
                    bound[alias.asname or alias.name] = sub
                elif target in files and target != module and _private(alias.name):
                    found.append((target, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in files:
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else local
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and bound.get(node.value.id, module) != module
            and _private(node.attr)
        ):
            found.append((bound[node.value.id], node.attr))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_private_imports_are_seen_in_every_form() -> None:
    """The check below finds a private name taken by ``from x import _y`` (absolute,
    relative, inside a function) and by ``x._y`` on an imported module; it lets through
    public names, dunders and a module's use of its own private names."""
    files = {m: Path() for m in ("kvtier.a", "kvtier.b", "kvtier.pkg", "kvtier.pkg.c")}
    source = (
        "from kvtier.a import _one, two, __version__\n"
        "from . import b\n"
        "import kvtier.pkg.c as c\n"
        "def f():\n"
        "    from .b import _three\n"
        "    return b._four, c._five, c.six, _own\n"
        "from kvtier.pkg import c as c2, _seven\n"
        "_own = c2._eight\n"
    )
    assert sorted(private_imports(source, "kvtier.d", False, files)) == [
        ("kvtier.a", "_one"),
        ("kvtier.b", "_four"),
        ("kvtier.b", "_three"),
        ("kvtier.pkg", "_seven"),
        ("kvtier.pkg.c", "_eight"),
        ("kvtier.pkg.c", "_five"),
    ]
    assert private_imports("from kvtier.a import _x\n", "kvtier.a", False, files) == []


def test_no_module_imports_another_modules_private_names() -> None:
    """A name starting with ``_`` is its module's own business: a module that takes one
    from another (codec's header helpers, the file tier's sweep flags, the Redis tiers'
    parser once did) ties the two together behind the name that says it is not shared.
    Make the name public where it is genuinely shared, or move the code to where it
    belongs."""
    files = module_files()
    taken = [
        f"{mod} takes {name} from {other}"
        for mod, path in files.items()
        for other, name in private_imports(path.read_text(), mod, path.name == "__init__.py", files)
    ]
    assert not taken, "private names imported across modules:\n" + "\n".join(taken)
