"""vLLM's config is read in two modules of kvtier, no more (issue 49, item 3).

:mod:`kvtier.connectors.engine_shape` reads what kvtier needs of vLLM's ``VllmConfig``
and ``KVCacheConfig`` into a frozen :class:`EngineShape`; the connector's entry,
:mod:`kvtier.connectors.vllm`, is handed both by vLLM and builds it. Every other module
takes the shape. This test parses every module of the package and fails naming the
module and line that reads vLLM's config anywhere else: an attribute of it (its
sub-configs, ``shutdown_timeout``, the KV cache's groups and tensors, the model's
``hf_config``), by attribute or by ``getattr``, or any attribute of a value named
``vllm_config`` or ``kv_cache_config``. Handing the config on unread (to vLLM's own base
class, as :mod:`kvtier.connectors.stats` does) is not reading it.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvtier"
#: the modules that may read vLLM's config: the engine shape, and the connector's entry
ALLOWED = {"kvtier/connectors/engine_shape.py", "kvtier/connectors/vllm.py"}
#: names a value of vLLM's config goes by in kvtier
CONFIG_NAMES = {"vllm_config", "kv_cache_config"}


def config_fields() -> set[str]:
    """The attributes that only vLLM's config has: ``VllmConfig``'s sub-configs (read
    from vLLM itself, so a config vLLM adds is covered) and ``shutdown_timeout``, the KV
    cache config's groups, tensors and specs, the model's ``hf_config``."""
    from vllm.config import VllmConfig

    engine = {f.name for f in dataclasses.fields(VllmConfig)}
    ours = {n for n in engine if n.endswith("_config")} | {"shutdown_timeout"}
    kv_cache = {"kv_cache_groups", "kv_cache_tensors", "kv_cache_spec"}
    return ours | kv_cache | {"hf_config", "hf_text_config"}


def config_reads(source: str, fields: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each read of vLLM's config in ``source``."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr in fields:
                out.append((node.lineno, f".{node.attr}"))
            elif isinstance(node.value, ast.Name) and node.value.id in CONFIG_NAMES:
                out.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
        ):
            what, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and name.value in fields:
                out.append((node.lineno, f"getattr(..., {name.value!r})"))
            elif isinstance(what, ast.Name) and what.id in CONFIG_NAMES:
                out.append((node.lineno, f"getattr({what.id}, ...)"))
    return sorted(out)


def test_only_the_engine_shape_and_the_connector_read_vllms_config() -> None:
    fields = config_fields()
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for line, what in config_reads(path.read_text(), fields):
            found.append(f"{rel}:{line}: {what}")
    assert not found, (
        "vLLM's config is read outside kvtier.connectors.engine_shape and the connector "
        "(take an EngineShape instead, and add what is missing to it):\n" + "\n".join(found)
    )


def test_the_rule_sees_every_way_of_reading_it() -> None:
    """The detector itself, on the reads the old modules made (so the test above can
    fail): sub-configs by attribute and by getattr, the KV cache's groups, and anything
    of a value named like vLLM's config; a config handed on unread is no read."""
    fields = config_fields()
    reads = [
        "n = vllm_config.cache_config.block_size",
        "p = getattr(vllm_config.parallel_config, 'nnodes', 1)",
        "cfg = getattr(config, 'kv_events_config', None)",
        "t = getattr(config, 'shutdown_timeout', None)",
        "g = kv_cache_config.kv_cache_groups[0]",
        "d = model.hf_config.to_dict()",
        "s = config.scheduler_config.max_num_batched_tokens",
        "x = getattr(vllm_config, 'anything', None)",
        "x = vllm_config.anything",
    ]
    for code in reads:
        assert config_reads(code, fields), code
    unread = [
        "super().__init__(vllm_config, metric_types, labelnames, values)",
        "shape = EngineShape.from_vllm(vllm_config, kv_cache_config)",
        "n = shape.block_size",
        "name = 'vllm:cache_config_info'",
    ]
    for code in unread:
        assert not config_reads(code, fields), code
