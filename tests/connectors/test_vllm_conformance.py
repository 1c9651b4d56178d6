"""kvtier's connector against vLLM's ``KVConnectorBase_V1`` of every supported release.

The suite runs vLLM's CPU build (``.venv``); GPU users run newer releases. Each
release's connector base class and the modules kvtier imports are read from that
release's own sources, without importing them (no GPU, ``.venv`` untouched): the
installed build from ``.venv``, the others from their wheel on the package index
(fetched once into ``.tools/``, see ``vllm_sources.py``). Checked:

- every abstract method of the base class is implemented;
- every public method kvtier defines is a hook of that release (a hook renamed or
  removed upstream would silently never be called), of the same kind (method,
  classmethod, property) and callable the way vLLM calls the base's;
- the hooks a release adds that kvtier must answer (sleep mode in 0.33; async loads,
  KV cache access and lookahead hashes in 0.34; KV events)
  are implemented;
- every ``from vllm... import name`` in ``connectors/`` resolves in that release.
"""

from __future__ import annotations

import ast

import pytest

from tests.connectors.vllm_sources import (
    REPO,
    Method,
    Param,
    Sources,
    class_methods,
    installed_sources,
    release_sources,
)

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
CONNECTOR = REPO / "kvtier" / "connectors" / "vllm.py"
#: newer releases than the CPU build in .venv, checked from their wheels
RELEASES = ["0.33.0", "0.34.0"]
_BASIC = {
    "take_events",
    "reset_cache",
    "request_finished",
    "build_connector_worker_meta",
    "requires_kv_delivery",
}
_SLEEP = {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}
#: 0.34: async loads that start while the batch is full, how the KV cache is reached,
#: lookahead block hashes (README: why kvtier answers each as it does)
_V034 = {"may_load_async", "kv_cache_access", "supports_lookahead_block_hashes"}
#: hooks each release must see answered by kvtier itself, not by the base's default
REQUIRED = {
    "installed": _BASIC,
    "0.33.0": _BASIC | _SLEEP,
    "0.34.0": _BASIC | _SLEEP | _V034,
}
#: kvtier's hooks that only newer releases call (each one is REQUIRED of a newer release)
NEWER_ONLY = {
    "installed": _SLEEP | _V034,
    "0.33.0": _V034,
    "0.34.0": set(),
}


@pytest.fixture(scope="module", params=["installed", *RELEASES])
def release(request: pytest.FixtureRequest) -> tuple[str, Sources]:
    version: str = request.param
    root = installed_sources() if version == "installed" else release_sources(version)
    return version, Sources(root)


def kvtier_methods() -> dict[str, Method]:
    return class_methods(ast.parse(CONNECTOR.read_text()), "KVTierConnector")


def call_problems(base: Method, ours: Method) -> list[str]:
    """Why vLLM calling ``ours`` as it calls ``base`` could fail (empty: it cannot)."""
    out: list[str] = []
    if base.kind != ours.kind:
        out.append(f"is a {ours.kind}, vLLM's is a {base.kind}")
    ours_pos = [p for p in ours.params if p.kind == "positional"]
    by_name = {p.name: p for p in ours.params if p.kind in ("positional", "keyword_only")}
    varargs = any(p.kind == "vararg" for p in ours.params)
    varkw = any(p.kind == "varkw" for p in ours.params)
    base_pos = [p for p in base.params if p.kind == "positional"]
    for i, bp in enumerate(base_pos):
        if i < len(ours_pos):
            op = ours_pos[i]
            if op.name != bp.name and not varkw:
                out.append(f"parameter {i + 1} is {op.name!r}, vLLM's is {bp.name!r}")
            if bp.has_default and not op.has_default:
                out.append(f"{op.name!r} needs a default (vLLM may leave it out)")
        elif not (varargs or (bp.name in by_name) or varkw):
            out.append(f"lacks vLLM's parameter {bp.name!r}")
    out += [
        f"its extra parameter {op.name!r} has no default"
        for op in ours_pos[len(base_pos) :]
        if not op.has_default
    ]
    for bp in base.params:
        if bp.kind == "keyword_only":
            op = by_name.get(bp.name)
            if op is None and not varkw:
                out.append(f"lacks vLLM's keyword {bp.name!r}")
            elif op is not None and bp.has_default and not op.has_default:
                out.append(f"{bp.name!r} needs a default (vLLM may leave it out)")
        if bp.kind == "varkw" and not varkw:
            out.append("lacks **kwargs (vLLM passes extra keywords)")
        if bp.kind == "vararg" and not varargs:
            out.append("lacks *args")
    out += [
        f"its keyword {p.name!r} has no default"
        for p in ours.params
        if p.kind == "keyword_only"
        and not p.has_default
        and not any(bp.name == p.name for bp in base.params)
    ]
    return out


def test_every_abstract_method_is_implemented(release: tuple[str, Sources]) -> None:
    version, src = release
    base = src.class_methods(BASE, "KVConnectorBase_V1")
    abstract = {name for name, m in base.items() if m.abstract}
    assert abstract, f"vLLM {version}: no abstract methods found (parser or layout changed)"
    missing = abstract - set(kvtier_methods())
    assert not missing, f"vLLM {version}: KVTierConnector lacks {sorted(missing)}"


def test_every_hook_kvtier_defines_exists_and_is_called_compatibly(
    release: tuple[str, Sources],
) -> None:
    version, src = release
    base = src.class_methods(BASE, "KVConnectorBase_V1")
    # SupportsHMA's hook (request_finished_all_groups), called instead of request_finished
    hma = src.class_methods(BASE, "SupportsHMA")
    assert "request_finished_all_groups" in hma, f"vLLM {version}: SupportsHMA changed"
    base = {**hma, **base}
    problems = []
    for name, ours in sorted(kvtier_methods().items()):
        if name.startswith("_") and name != "__init__":
            continue  # kvtier's own helpers
        if name not in base:
            if name in NEWER_ONLY[version]:
                continue
            problems.append(f"{name}: not a hook of vLLM {version} (never called)")
            continue
        problems += [f"{name}: {p}" for p in call_problems(base[name], ours)]
    assert not problems, f"vLLM {version}:\n" + "\n".join(problems)


def test_the_hooks_a_release_needs_answered_are_implemented(
    release: tuple[str, Sources],
) -> None:
    version, src = release
    base = src.class_methods(BASE, "KVConnectorBase_V1")
    required = REQUIRED[version]
    assert required <= set(base), f"vLLM {version} lacks {sorted(required - set(base))}"
    assert required <= set(kvtier_methods()), sorted(required - set(kvtier_methods()))
    newer = set().union(*(REQUIRED[v] for v in RELEASES))
    assert NEWER_ONLY[version] <= newer - set(base), "NEWER_ONLY lists only newer hooks"


def test_every_vllm_import_of_the_connector_resolves(release: tuple[str, Sources]) -> None:
    version, src = release
    missing = []
    connectors = REPO / "kvtier" / "connectors"
    for path in sorted(connectors.rglob("*.py")):  # its scheduler/ and worker/ too
        name = path.relative_to(connectors).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                assert node.module is not None
                if src.tree(node.module) is None:
                    missing.append(f"{name}: module {node.module}")
                    continue
                missing += [
                    f"{name}: {node.module}.{a.name}"
                    for a in node.names
                    if not src.defines(node.module, a.name)
                ]
            elif isinstance(node, ast.Import):
                missing += [
                    f"{name}: module {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "vllm" and src.tree(a.name) is None
                ]
    assert not missing, f"vLLM {version}:\n" + "\n".join(missing)


def test_the_kv_cache_access_kvtier_answers_is_the_releases(
    release: tuple[str, Sources],
) -> None:
    """``kv_cache_access`` reads ``KVCacheAccess`` off the module (older releases lack the
    name, so it cannot be a ``from`` import the check above sees): where the hook exists,
    the module defines it."""
    version, src = release
    if "kv_cache_access" not in src.class_methods(BASE, "KVConnectorBase_V1"):
        assert version in ("installed", "0.33.0"), version
        return
    assert src.defines("vllm.config.kv_transfer", "KVCacheAccess"), version
    assert "kv_transfer.KVCacheAccess.IN_PROCESS" in CONNECTOR.read_text()


def test_the_gpu_extra_allows_exactly_the_checked_releases() -> None:
    """``pip install kvtier[gpu]`` accepts the releases checked here and none after them:
    a new vLLM release goes into RELEASES before the pin lets users install it."""
    import re
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (gpu,) = extras["gpu"]
    m = re.fullmatch(r"vllm>=(\d+)\.(\d+),<(\d+)\.(\d+)", gpu.replace(" ", ""))
    assert m, gpu
    low, high = (int(m[1]), int(m[2])), (int(m[3]), int(m[4]))
    (cpu,) = extras["cpu"]
    installed = tuple(int(x) for x in cpu.split("==")[1].split(".")[:2])
    newest = max(tuple(int(x) for x in v.split(".")[:2]) for v in RELEASES)
    assert low == installed, (gpu, cpu)
    assert high == (newest[0], newest[1] + 1), (gpu, RELEASES)


# ---- the checker itself can fail ----------------------------------------------------------
def _m(kind: str, *params: Param) -> Method:
    return Method("f", kind, False, params)


P = Param


@pytest.mark.parametrize(
    ("base", "ours", "problem"),
    [
        (
            _m("method", P("x", "positional", False)),
            _m("method", P("y", "positional", False)),
            "parameter 1 is 'y'",
        ),
        (
            _m("method", P("x", "positional", True)),
            _m("method", P("x", "positional", False)),
            "needs a default",
        ),
        (_m("method", P("x", "positional", False)), _m("method"), "lacks vLLM's parameter"),
        (_m("method"), _m("method", P("x", "positional", False)), "has no default"),
        (_m("method", P("kw", "varkw", True)), _m("method"), "lacks **kwargs"),
        (_m("classmethod"), _m("method"), "is a method, vLLM's is a classmethod"),
        (_m("method", P("k", "keyword_only", False)), _m("method"), "lacks vLLM's keyword"),
    ],
)
def test_call_problems_finds_each_mismatch(base: Method, ours: Method, problem: str) -> None:
    assert any(problem in p for p in call_problems(base, ours)), call_problems(base, ours)


def test_call_problems_accepts_compatible_overrides() -> None:
    base = _m("method", P("a", "positional", False), P("kw", "varkw", True))
    ours = _m(
        "method",
        P("a", "positional", False),
        P("extra", "positional", True),
        P("kw", "varkw", True),
    )
    assert call_problems(base, ours) == []


def test_sources_answer_what_a_module_defines() -> None:
    src = Sources(installed_sources())
    assert src.defines(BASE, "KVConnectorBase_V1")
    assert not src.defines(BASE, "NoSuchHook")
    assert src.tree("vllm.no_such_module") is None
