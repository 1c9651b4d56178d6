"""kvtier's I/O threads run on every CPU the engine was given, not only on the one core
vLLM's CPU build pins its main thread (and so every thread it starts) to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtier.threads import _cpu_list, engine_cpus

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="affinity needs two CPUs to differ")


def test_cpu_lists_parse() -> None:
    assert _cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert _cpu_list("0 1") == {0, 1}
    assert _cpu_list("0-7:2") == {0, 2, 4, 6}
    assert _cpu_list("x, 3-1, 2:0, 5") == {5}
    assert _cpu_list("") == set()


@needs_two
def test_engine_cpus_sees_every_threads_cpus_and_gomps_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GOMP_CPU_AFFINITY", f"{CPUS[0]}")
    assert engine_cpus() >= set(CPUS)  # this (unpinned) thread's CPUs are in
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0-3 garbage")
    assert engine_cpus() >= {0, 1, 2, 3}


# vLLM's CPU worker sets GOMP_CPU_AFFINITY before torch loads libgomp, which pins the
# main thread to the list's first CPU at once: every thread it starts inherits that CPU
_ENGINE = """
import json, os, sys
import torch  # libgomp binds the main thread here
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers import FileTier
from kvtier.objects import codec

seen = []
class Tier(FileTier):
    def read_into(self, key, dest, max_head):
        seen.append(sorted(os.sched_getaffinity(0)))
        return super().read_into(key, dest, max_head)

tier = Tier(sys.argv[1])
payload = bytes(4096)
tier.put("k", codec.encode("k", payload, dtype="uint8", shape=[4096], signer=None))
rio = RemoteIO(tier, threads=2, queue_depth=4, timeout_s=20.0, signer=None)
slot = memoryview(bytearray(4096))
rio.submit_get_into(1, "k", slot, dtype="uint8", shape=[4096])
got = []
while not got:
    got = rio.poll()
rio.close()
print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "io": seen, "ok": got[0].ok}))
"""


@needs_two
def test_io_threads_leave_the_pinned_main_threads_core(tmp_path: Path) -> None:
    env = {**os.environ, "GOMP_CPU_AFFINITY": " ".join(map(str, CPUS[:2])),
           "OMP_NUM_THREADS": "2"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", _ENGINE, str(tmp_path / "o")], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["main"] == [CPUS[0]], got  # the situation: the main thread pinned
    assert got["ok"] and got["io"] == [CPUS[:2]], got


@needs_two
def test_an_io_thread_started_by_a_pinned_thread_is_widened(tmp_path: Path) -> None:
    """The same without libgomp: a thread pinned to one CPU starts RemoteIO."""
    from kvtier.objects import codec
    from kvtier.objects.remote import RemoteIO
    from kvtier.objects.tiers import FileTier

    seen: list[set[int]] = []

    class Tier(FileTier):
        def read_into(self, key: str, dest: memoryview, max_head: int) -> bytes | None:
            seen.append(os.sched_getaffinity(0))
            return super().read_into(key, dest, max_head)

    tier = Tier(str(tmp_path / "o"))
    tier.put("k", codec.encode("k", bytes(4096), dtype="uint8", shape=[4096], signer=None))
    box: list[RemoteIO] = []

    def pinned() -> None:
        os.sched_setaffinity(0, {CPUS[0]})
        box.append(RemoteIO(tier, threads=2, queue_depth=4, timeout_s=20.0, signer=None))

    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    rio = box[0]
    try:
        rio.submit_get_into(1, "k", memoryview(bytearray(4096)), dtype="uint8", shape=[4096])
        got = []
        while not got:
            got = rio.poll()
        assert got[0].ok
    finally:
        rio.close()
    assert seen == [set(CPUS)]
