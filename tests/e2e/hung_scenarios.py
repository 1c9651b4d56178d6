"""Engine scenario for tests/e2e/test_hung_tier.py: an object tier whose every call hangs.

Loaded by tests/e2e/engine.py through ``KVTIER_TEST_SCENARIO_MODULES``. The file tier's
calls are made to block for good (a hung NFS mount) in the engine's own process (the
engine core and its worker run in-process), so the real connector, scheduler and
RemoteIO meet a tier that never answers.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.e2e.engine import build_llm, generate, register, shutdown, toks


@register
def hung_tier(model: str, extra: dict[str, Any], n_prompts: int) -> dict[str, Any]:
    from kvtier import metrics
    from kvtier.objects.health import ConstantBackoff
    from kvtier.objects.remote import RemoteIO
    from kvtier.objects.tiers.file import FileTier
    from kvtier.stats import StatsRecorder

    hang = threading.Event()  # set only once the engine is shut down
    calls = {"read_into": 0, "read_into_hashed": 0, "exists": 0, "put": 0}
    on_read_threads = [0]  # backend calls a read thread made (a read, or the stat before it)

    def hanging(name: str) -> Any:
        real = getattr(FileTier, name)

        def call(self: FileTier, *a: Any, **kw: Any) -> Any:
            calls[name] += 1
            on_read_threads[0] += threading.current_thread().name.startswith("kvtier-read")
            hang.wait()
            return real(self, *a, **kw)

        return call

    for name in list(calls):
        setattr(FileTier, name, hanging(name))
    delays: list[float] = []  # every object-tier lookup's wait, as kvtier measures it
    observe = StatsRecorder.observe

    def observing(self: StatsRecorder, spec: Any, value: float, labels: tuple = ()) -> None:
        if spec is metrics.LOOKUP_DELAY and labels == ("async",):
            delays.append(float(value))
        observe(self, spec, value, labels)

    StatsRecorder.observe = observing  # type: ignore[method-assign]
    rios: list[RemoteIO] = []
    init = RemoteIO.__init__

    def recording(self: RemoteIO, *a: Any, **kw: Any) -> None:
        # down for the whole run once marked down: the probe after each backoff would
        # cost one more lookup deadline, and how many backoffs end within the prompts
        # depends on how busy the machine is (probing: tests/objects/test_health_probe_wait.py)
        kw["backoff"] = ConstantBackoff(600.0)
        init(self, *a, **kw)
        rios.append(self)

    RemoteIO.__init__ = recording  # type: ignore[method-assign]
    llm = build_llm(model, extra)
    rio = rios[0]
    threads_before = threading.active_count()
    seconds = []
    for i in range(n_prompts):
        t0 = time.monotonic()
        generate(llm, [toks(300 + i, 1024 + 40)], max_tokens=2)
        seconds.append(time.monotonic() - t0)
    during = {
        "stuck_reads": getattr(rio, "stuck_reads", None),
        "read_threads": rio.read_threads,
        "reads_out": len(rio.queue._inflight),
        "pending_writes": rio.pending_writes,
        "threads_grew": threading.active_count() - threads_before,
        "counters": rio.counters(),
    }
    calls_before_shutdown = {**calls, "on_read_threads": on_read_threads[0]}
    shutdown(llm)  # the flush meets uploads that never finish
    report = getattr(rio, "last_flush", None)
    hang.set()
    return {
        "delays": delays,
        "seconds": seconds,
        "calls": calls_before_shutdown,
        "during": during,
        "flush": None
        if report is None
        else {
            "pending": report.pending,
            "written": report.written,
            "failed": report.failed,
            "queued": report.queued,
            "writing": report.writing,
            "text": report.describe(),
        },
    }
