"""No module of kvtier reads a private attribute that another module's class owns.

A leading underscore says "this module's business": a name the owning class may rename,
drop or change the meaning of without asking anyone. A read of it from another module
ties the two together as firmly as an import cycle, and hides the tie from the reader of
the owner. When another module needs it, the owner gives it a public name (a method, a
property, or a shared public function).

The scan parses every module of ``kvtier/`` and fails on each read of a private name
(``_x``, not a dunder) that the module does not own:

- ``expr._x`` and ``getattr(expr, "_x")`` (``hasattr``, ``setattr``, ``delattr`` alike)
  for any ``expr``;
- ``self._x`` and ``cls._x`` too: a name no class of this module defines is inherited
  from another module's class;
- ``super()._x`` in a class none of whose bases is defined in this module.

A module owns a private name that one of its classes defines (a method, a class
attribute, ``self._x = ...``) or that it stores on any object (``obj._x = ...``: kvtier's
own marks on vLLM's objects). What kvtier cannot avoid reading in other libraries (vLLM,
redis-py, torch, the standard library) is :data:`ALLOWED`, each with why.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (module file under kvtier/, private name) -> why kvtier reads another library's private
ALLOWED: dict[tuple[str, str], str] = {
    # -- the standard library: documented names that happen to start with "_"
    ("cli/demo.py", "_exit"): "os._exit: the documented exit without cleanup (a forked child)",
    ("connectors/engine_shape.py", "_getframe"): "sys._getframe: the documented frame reader",
    ("connectors/scheduler/weights.py", "_getframe"): "sys._getframe, as above",
    ("cli/doctor.py", "_SubParsersAction"): "argparse's type of add_subparsers(), annotation",
    ("cli/size.py", "_SubParsersAction"): "argparse's type of add_subparsers(), annotation",
    ("cli/store.py", "_SubParsersAction"): "argparse's type of add_subparsers(), annotation",
    ("objects/io_queue.py", "_get"): "queue.Queue's hook for subclasses (its docs: override _get)",
    ("objects/io_queue.py", "_init"): "queue.Queue's hook for subclasses (override _init)",
    # -- vLLM
    (
        "connectors/vllm.py",
        "_get_connector_metadata",
    ): "KVConnectorBase_V1's getter of the step's metadata, for its subclasses only ('called "
    "inside the connector'); vLLM has no public one",
    # -- redis-py: kvtier bounds the replies it parses and the cluster's topology refreshes
    ("objects/tiers/redis_resp.py", "_read_from_socket"): "redis-py SocketBuffer's read hook",
    ("objects/tiers/redis_resp.py", "_read_response"): "redis-py _RESP2Parser's reply hook",
    ("objects/tiers/redis_resp.py", "_construct_command_packer"): "redis-py Connection's hook",
    ("objects/tiers/redis_resp.py", "_connect"): "redis-py Connection's socket hook",
    ("objects/tiers/redis_cluster.py", "_request_refresh"): "redis-py 8 NodesManager: a "
    "requested topology refresh (no public API; without it, the public initialize())",
    ("objects/tiers/redis_cluster.py", "_run_requested_refresh"): "as _request_refresh",
    ("objects/tiers/redis_cluster.py", "_refresh_requested"): "as _request_refresh",
    # -- torch
    ("host/transfer.py", "_foreach_copy_"): "torch's batched copy, looked up where it exists",
    ("sizing/model.py", "_is_avx512_bf16_supported"): "torch.cpu's ISA probe (no public one)",
}


def _private(name: str) -> bool:
    return (
        name.startswith("_")
        and len(name) > 1
        and not (name.startswith("__") and name.endswith("__"))
    )


def owned(tree: ast.AST) -> set[str]:
    """The private names a module owns: defined in its classes' bodies, stored on
    ``self`` or on any object anywhere in it."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(sub.name)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def _is_super(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def private_reads(source: str) -> Iterator[tuple[int, str, str]]:
    """(line, what, name) for each read of a private name ``source`` does not own."""
    tree = ast.parse(source)
    own = owned(tree)
    local_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = {ast.unparse(b) for b in cls.bases}
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and _is_super(node.value) and _private(node.attr):
                if not bases & local_classes:
                    yield (
                        node.lineno,
                        f"super()._ in {cls.name}({', '.join(sorted(bases))})",
                        node.attr,
                    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if _is_super(node.value) or node.attr in own:
                continue
            yield node.lineno, ast.unparse(node.value), node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in own
        ):
            yield node.lineno, f"{node.func.id}({ast.unparse(node.args[0])})", node.args[1].value


def _modules() -> dict[str, str]:
    return {
        p.relative_to(ROOT / "kvtier").as_posix(): p.read_text()
        for p in sorted((ROOT / "kvtier").rglob("*.py"))
    }


def test_no_module_reads_a_private_name_another_module_owns() -> None:
    found = [
        f"kvtier/{mod}:{line}: {what}.{name}"
        for mod, source in _modules().items()
        for line, what, name in private_reads(source)
        if (mod, name) not in ALLOWED
    ]
    assert not found, (
        "private names read across modules (give the owner a public name, or, for another "
        "library's, add it to ALLOWED with why):\n" + "\n".join(found)
    )


def test_every_allowed_read_still_happens() -> None:
    """An allowance whose read is gone is stale: remove it."""
    seen = {
        (mod, name) for mod, source in _modules().items() for _, _, name in private_reads(source)
    }
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"ALLOWED names reads that no longer happen: {stale}"


# ----------------------------------------------------------- the scan can fail (self-check)


def test_the_scan_sees_what_it_looks_for() -> None:
    source = (
        "from other import Base\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "    def _helper(self):\n"
        "        return self._own + self.__class__.__name__.__len__()\n"
        "class Sub(Base):\n"
        "    def f(self, conn, st):\n"
        "        conn._sock = None\n"  # a store: kvtier's own mark on conn
        "        return (\n"
        "            conn.connector._scheduler,\n"  # another's private: flagged
        "            getattr(st, '_hidden', None),\n"  # flagged
        "            self._inherited,\n"  # from Base, another module: flagged
        "            super()._fail(),\n"  # Base's: flagged
        "            st._own, st._sock, Mine()._helper(),\n"  # this module's own: fine
        "        )\n"
        "class Local(Mine):\n"
        "    def g(self):\n"
        "        return super()._helper()\n"  # a base of this module: fine
    )
    assert sorted((name, what) for _, what, name in private_reads(source)) == [
        ("_fail", "super()._ in Sub(Base)"),
        ("_hidden", "getattr(st)"),
        ("_inherited", "self"),
        ("_scheduler", "conn.connector"),
    ]
