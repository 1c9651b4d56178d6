"""Engine scenarios for tests/e2e/test_redis_cluster_tier.py.

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``. ``cluster_outage``
is engine.py's ``outage`` scenario with one addition: every finished request's object-tier
keys are written to ``keys.json`` in the signal directory as they finish, so the test can
tell, before it kills a primary, which node holds which chunk of which prompt.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.e2e import engine as _engine_mod
from tests.e2e.engine import kvtier_side, register


def _record_keys(llm: Any, path: str) -> None:
    """After each request with full chunks: ``path`` holds ``{"chunk_size": n, "requests":
    [[request id, [object key of chunk 0, 1, ...]], ...]}`` in finish order (rank 0's keys,
    the worker's namespace; replaced atomically so a reader never sees half a file)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvtier.keys import KeySpace

    side = kvtier_side(llm)
    done: list[list[Any]] = []
    original = side.request_finished

    def request_finished(request: Any, block_ids: Any) -> Any:
        st = side._reqs.get(request.request_id)
        if st is not None:
            side.keys.refresh(st)
            worker = get_kv_transfer_group()._worker
            rank0 = KeySpace.worker(worker.namespace, 0, 0)
            keys = [rank0.key(h) for h in st.chunk_hashes]
            if keys:
                done.append([request.request_id, keys])
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump({"chunk_size": side.chunk_size, "requests": done}, f)
                os.replace(tmp, path)
        return original(request, block_ids)

    side.request_finished = request_finished


@register
def cluster_outage(
    model: str, extra: dict[str, Any], seeds: list[int], signal_dir: str
) -> dict[str, Any]:
    """engine.py's ``outage`` (sequential rounds), its requests' keys in ``keys.json``."""
    path = os.path.join(signal_dir, "keys.json")
    real_build = _engine_mod.build_llm

    def build(model: str, extra: dict[str, Any] | None, **kw: Any) -> Any:
        llm = real_build(model, extra, **kw)
        _record_keys(llm, path)
        return llm

    _engine_mod.build_llm = build  # outage() looks build_llm up in its module at call time
    try:
        return _engine_mod.outage(model, extra, seeds, signal_dir)
    finally:
        _engine_mod.build_llm = real_build
