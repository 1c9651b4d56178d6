"""Every kvtier metric in one place: name, type, help, labels and buckets.

The connector exports these through vLLM's own stats path, so they appear on
the API server's ``/metrics`` beside the ``vllm:*`` metrics (vLLM adds its own
``model_name`` and ``engine`` labels in front of the labels listed here). The
Grafana dashboard and the Prometheus rules in ``deploy/`` are checked against
this list by the tests: every name they use is defined here, and every name
defined here is shown on the dashboard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

PREFIX = "kvtier:"

#: lookup-delay buckets: 0.1 ms to 10 s
LOOKUP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: time-to-first-token buckets, seconds (the same as vLLM's own TTFT histogram)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
#: per-chunk transfer buckets, seconds
TRANSFER_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)

TIERS = ("host", "remote")
OUTCOMES = ("hit", "partial", "miss")
LOOKUP_MODES = ("sync", "async")
DIRECTIONS = ("read", "write")
TRANSFER_OPS = ("store", "load", "fetch", "upload")
#: the what-if tiers' sizes as multiples of the real tier's (kvtier.whatif.host.SCALES)
WHATIF_SCALES = ("0.5", "1", "2", "4", "8")
#: "object": one object could not be read or written (disk full, a Redis key of the wrong
#: type, not a regular file) while the tier works; "oversize": an object larger than its slot,
#: never read; "sealed": a sealed (encrypted) chunk this engine holds no key for; "node": one
#: node of a Redis Cluster could not be reached (its slots miss, the other nodes serve);
#: "format": a chunk stored in a compressed form this engine cannot read
ERROR_KINDS = (
    "checksum",
    "truncated",
    "signature",
    "sealed",
    "wrong_key",
    "malformed",
    "timeout",
    "unreachable",
    "tier",
    "load",
    "object",
    "oversize",
    "node",
    "format",
)


#: why prompt tokens kvtier was asked about were not served (``kvtier:miss_tokens``):
#: "absent": no tier held the chunk (never stored, evicted, or not in the object tier; a
#: fetch that failed is also in ``kvtier:errors`` by kind); "tier_down": absent while the
#: object tier's reads failed fast after a failure to reach it; "storing": its store was still
#: unreported after the request waited ``lookup_timeout_ms`` for it; "fetching": its fetch
#: was still in flight when the lookup timed out; "evicting": it was being dropped (a
#: reset, a write-back eviction); "tail": the prompt past its last full chunk, up to the
#: token vLLM computes itself (kvtier holds whole chunks only); "load_failed": offered and
#: loaded, but the load failed (a one-step lookup's fetch that failed, a copy error) and
#: vLLM computed them; "declined": a priced lookup did not ask the object tier for them,
#: loading was predicted slower than computing (``load_policy: cost``, kvtier.costs)
MISS_REASONS = (
    "absent",
    "tier_down",
    "storing",
    "fetching",
    "evicting",
    "tail",
    "load_failed",
    "declined",
)
#: what a canary found (the ``outcome`` of ``kvtier:canary_checks``, kvtier.canary): the
#: chunk vLLM computed matched the stored one or did not; "absent": the tier does not hold
#: it; "error": it could not be read or verified, or the computed chunk was not stored
CANARY_RESULTS = ("match", "mismatch", "absent", "error")
#: why a lookup asked the object tier for fewer chunks than it could (``load_policy: cost``,
#: kvtier.costs): "slower_than_prefill": reading them was predicted to take longer than
#: computing them; "queued": they would have been worth it but for the fetches already in
#: flight ahead of them
DECLINE_REASONS = ("slower_than_prefill", "queued")
#: what became of the hot chunks the object tier lacked when the engine drained
#: (``kvtier:handoff_chunks``): "written" by the flush, or "left" (not written in time,
#: refused or failed)
HANDOFF_OUTCOMES = ("written", "left")


def error_kind_label(kind: str) -> str:
    """The ``kind`` label for an error: a known kind as is, anything else "tier"."""
    return kind if kind in ERROR_KINDS else "tier"


_ADDRESS = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,253}:[0-9]{1,5}")


class NodeAddresses(tuple[str, ...]):
    """The values of the ``node`` label: a node's ``host:port``, known only at run time,
    or "other" past :data:`NODE_LABELS` addresses per process. Iterating it gives "other"
    alone, the one series created up front (at 0, so the series and its panel exist
    before any node fails)."""

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and (
            value == "other" or _ADDRESS.fullmatch(value) is not None
        )


#: distinct node addresses one process labels on its own (the rest are "other")
NODE_LABELS = 32

#: why a chunk left the host tier to make room (``kvtier:evictions``): "lru": the least
#: recently used chunk no tenant's quota protects; "tenant_quota": a tenant at (or over)
#: its quota lost its own oldest chunk; "pinned": a soft pin, when no unpinned chunk could go
EVICTION_REASONS = ("lru", "tenant_quota", "pinned")
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class TenantLabels(tuple[str, ...]):
    """The values of the ``tenant`` label: a tenant's name (kvtier.config.tenants), known
    only at run time, "untagged", or "other" past ``tenant_metrics_max`` tenants. Iterating
    it gives the series created up front."""

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and _TENANT.fullmatch(value) is not None


#: what a priced lookup's wait is (``kvtier:priced_fetch_seconds``): the cost model's
#: prediction, or the wait the request had
PRICED_FETCH_VALUES = ("predicted", "measured")

#: every value each label takes (children are created up front, so dashboards see zeros)
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "tier": TIERS,
    "outcome": OUTCOMES,
    "mode": LOOKUP_MODES,
    "direction": DIRECTIONS,
    "op": TRANSFER_OPS,
    "kind": ERROR_KINDS,
    "reason": MISS_REASONS,
    "node": NodeAddresses(("other",)),
    "scale": WHATIF_SCALES,
    "tenant": TenantLabels(("untagged", "other")),
    "value": PRICED_FETCH_VALUES,
}


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric. ``name`` is the full Prometheus name without suffixes."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


LOOKUP_TOKENS = MetricSpec(
    PREFIX + "lookup_tokens",
    "counter",
    "Prompt tokens kvtier was asked about (beyond vLLM's own prefix-cache hit).",
)
HIT_TOKENS = MetricSpec(
    PREFIX + "hit_tokens",
    "counter",
    "Prompt tokens served from kvtier instead of being recomputed, by the tier that held them.",
    ("tier",),
)
TTFT = MetricSpec(
    PREFIX + "ttft_seconds",
    "histogram",
    "Time from a request's arrival to the end of its prefill, by kvtier outcome.",
    ("outcome",),
    TTFT_BUCKETS,
)
LOOKUP_DELAY = MetricSpec(
    PREFIX + "lookup_delay_seconds",
    "histogram",
    "Lookup delay: 'sync' is time spent inside the scheduler call, 'async' is how long a "
    "request waited for an object-tier lookup and prefetch.",
    ("mode",),
    LOOKUP_BUCKETS,
)
BYTES = MetricSpec(
    PREFIX + "bytes",
    "counter",
    "KV bytes moved, by tier and direction (read = into vLLM's cache or host tier).",
    ("tier", "direction"),
)
TRANSFER_SECONDS = MetricSpec(
    PREFIX + "transfer_seconds",
    "histogram",
    "Time to move one chunk: store (GPU->host), load (host->GPU), fetch (object->host), "
    "upload (host->object).",
    ("op",),
    TRANSFER_BUCKETS,
)
HOST_BYTES_USED = MetricSpec(
    PREFIX + "host_bytes_used",
    "gauge",
    "Bytes of the host tier holding chunks.",
)
HOST_BYTES_CAPACITY = MetricSpec(
    PREFIX + "host_bytes_capacity",
    "gauge",
    "Size of the host tier (its one slab), bytes.",
)
EVICTIONS = MetricSpec(
    PREFIX + "evictions",
    "counter",
    "Chunks evicted from the host tier to make room, by reason (EVICTION_REASONS).",
    ("reason",),
)
WRITES_DROPPED = MetricSpec(
    PREFIX + "writes_dropped",
    "counter",
    "Object-tier writes dropped because the write queue was full (backpressure).",
)
STORES_SKIPPED = MetricSpec(
    PREFIX + "stores_skipped",
    "counter",
    "Chunks not stored because every host slot was busy loading, fetching or uploading.",
)
ERRORS = MetricSpec(
    PREFIX + "errors",
    "counter",
    "Chunks or operations that failed and became misses, by kind.",
    ("kind",),
)
STUCK_OPS = MetricSpec(
    PREFIX + "stuck_ops",
    "gauge",
    "Object-tier reads past their deadline (writes past their stall bound) whose backend "
    "call has not returned; each holds an I/O thread, a read also its host slot.",
    ("direction",),
)
SEALS = MetricSpec(
    PREFIX + "seals",
    "counter",
    "Chunks sealed (AES-GCM, one random 96-bit nonce each) with the engine's encryption "
    "key; summed over every engine that shares a key, keep it far below 2**32.",
)


MISS_TOKENS = MetricSpec(
    PREFIX + "miss_tokens",
    "counter",
    "Prompt tokens kvtier was asked about and did not serve, by why (MISS_REASONS); with "
    "hit_tokens they add up to lookup_tokens.",
    ("reason",),
)


NODE_ERRORS = MetricSpec(
    PREFIX + "node_errors",
    "counter",
    "Object-tier calls that failed because one Redis Cluster node could not be reached, by "
    "node address (at most 32 per process, the rest 'other'); also in errors{kind=\"node\"}.",
    ("node",),
)

COMPRESS_RAW_BYTES = MetricSpec(
    PREFIX + "compress_raw_bytes",
    "counter",
    "KV bytes of the chunks the object tier wrote (write) or served (read), before "
    "compression; with compress_stored_bytes the tier's compression ratio.",
    ("direction",),
)
COMPRESS_STORED_BYTES = MetricSpec(
    PREFIX + "compress_stored_bytes",
    "counter",
    "The same chunks' payload bytes as stored in the object tier (compressed, or raw where "
    "compression is off or did not pay).",
    ("direction",),
)
COMPRESS_SECONDS = MetricSpec(
    PREFIX + "compress_seconds",
    "counter",
    "Seconds the object-tier I/O threads spent compressing (write) and decompressing (read).",
    ("direction",),
)
WHATIF_HIT_TOKENS = MetricSpec(
    PREFIX + "whatif_hit_tokens",
    "counter",
    "Prompt tokens a tier of scale times today's size would have served (ghost tiers of "
    'chunk keys fed by the real tier\'s lookups, stores and evictions): tier="host" scales '
    "the host tier's slots, tier=\"remote\" the object tier's file_max_bytes (unbounded: "
    "scales >= 1 are the tier itself, 0.5 half its current size), as this engine sees it. "
    "The denominator is lookup_tokens; scale 1 equals hit_tokens of the same tier.",
    ("tier", "scale"),
)
CANARY = MetricSpec(
    PREFIX + "canary_checks",
    "counter",
    "Chunks vLLM computed and compared with the object tier's chunk of the same name "
    "(canary_first_hit, canary_rate), by outcome; a mismatch means the generation holds "
    "other weights' KV (a stale model_fingerprint): this engine refused it and carries on "
    "under a generation of its own (a fork).",
    ("outcome",),
)
LOADS_DECLINED = MetricSpec(
    PREFIX + "loads_declined_tokens",
    "counter",
    "Prompt tokens an object-tier lookup did not ask the tier for because loading them was "
    "predicted to be slower than computing them (load_policy: cost), by tier and why; the "
    "tier may not have held them all.",
    ("tier", "reason"),
)
FETCH_DEADLINE_MISSED = MetricSpec(
    PREFIX + "fetch_deadline_missed",
    "counter",
    "Lookups whose fetch was still running at its deadline (the predicted fetch or the "
    "recompute it replaces, whichever is shorter): the request went on with the chunks that "
    "had landed.",
    ("tier",),
)
PRICED_FETCH_SECONDS = MetricSpec(
    PREFIX + "priced_fetch_seconds",
    "histogram",
    "Priced lookups that asked the tier for chunks (load_policy: cost): the wait the cost "
    "model predicted ('predicted') and the wait the request had ('measured', until its chunks "
    "landed, its deadline or lookup_timeout_ms), by tier.",
    ("tier", "value"),
    LOOKUP_BUCKETS,
)
TIER_READ_BPS = MetricSpec(
    PREFIX + "tier_read_bytes_per_second",
    "gauge",
    "Read throughput of a tier as lookups see it (median of recent fetch runs, all workers' "
    "bytes); 0 until measured.",
    ("tier",),
)
PREFILL_SPT = MetricSpec(
    PREFIX + "prefill_seconds_per_token",
    "gauge",
    "What one more prompt token costs this engine to compute (median of recent steps of at "
    "least a chunk of tokens, a step's fixed cost taken off); 0 until measured.",
)
TENANT_BYTES = MetricSpec(
    PREFIX + "tenant_bytes",
    "gauge",
    "Bytes of a tier holding a tenant's chunks (a chunk counts once, to the tenant that "
    "stored it); at most tenant_metrics_max tenants, the rest 'other'.",
    ("tier", "tenant"),
)
TENANT_HIT_TOKENS = MetricSpec(
    PREFIX + "tenant_hit_tokens",
    "counter",
    "Prompt tokens kvtier offered a tenant's requests and vLLM took (planned loads), by "
    "tenant; at most tenant_metrics_max tenants, the rest 'other'.",
    ("tenant",),
)
TENANT_LOOKUP_TOKENS = MetricSpec(
    PREFIX + "tenant_lookup_tokens",
    "counter",
    "Prompt tokens kvtier was asked about for a tenant's requests (lookup_tokens by tenant).",
    ("tenant",),
)
PINNED_BYTES = MetricSpec(
    PREFIX + "pinned_bytes",
    "gauge",
    "Bytes of the host tier holding soft-pinned chunks (at most pin_max_fraction of it).",
)
#: label values of one metric where they differ from :data:`LABEL_VALUES` (the canary's
#: ``outcome`` is not a lookup's): (metric name, label) -> values
METRIC_LABEL_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    (CANARY.name, "outcome"): CANARY_RESULTS,
    (LOADS_DECLINED.name, "reason"): DECLINE_REASONS,
    (EVICTIONS.name, "reason"): EVICTION_REASONS,
    (TENANT_BYTES.name, "tier"): ("host",),
    (PREFIX + "handoff_chunks", "outcome"): HANDOFF_OUTCOMES,
}


def label_values(spec: MetricSpec, label: str) -> tuple[str, ...]:
    """Every value ``label`` takes on ``spec``'s series."""
    return METRIC_LABEL_VALUES.get((spec.name, label)) or LABEL_VALUES[label]


HANDOFF_CHUNKS = MetricSpec(
    PREFIX + "handoff_chunks",
    "counter",
    "Hot host-tier chunks the object tier lacked when the engine drained (write_back), by "
    "outcome: written first by the shutdown flush, hottest first, or left (not written "
    "within shutdown_flush_s, refused or failed). Recorded in the worker's shutdown, after "
    "vLLM's last stats pass, so it does not reach /metrics: the log line is the report.",
    ("outcome",),
)
WARMUP_BYTES = MetricSpec(
    PREFIX + "warmup_bytes",
    "counter",
    "Bytes a starting engine's warm-up (warmup: true) fetched from the object tier into its "
    "host tier before it served, every worker's together.",
)
WARMUP_SECONDS = MetricSpec(
    PREFIX + "warmup_seconds",
    "gauge",
    "How long the engine's warm-up took (the slowest worker's; at most warmup_timeout_s plus "
    "one read). 0 when the engine did not warm up.",
)
WARMUP_HIT_TOKENS = MetricSpec(
    PREFIX + "warmup_hit_tokens",
    "counter",
    "Prompt tokens loaded from host-tier chunks that warm-up brought in (a part of "
    'hit_tokens{tier="host"}, counted as the loads are planned).',
)


#: every metric kvtier exports (the dashboards and rules are checked against it)
ALL: tuple[MetricSpec, ...] = (
    LOOKUP_TOKENS,
    HIT_TOKENS,
    MISS_TOKENS,
    TTFT,
    LOOKUP_DELAY,
    BYTES,
    TRANSFER_SECONDS,
    HOST_BYTES_USED,
    HOST_BYTES_CAPACITY,
    EVICTIONS,
    WRITES_DROPPED,
    STORES_SKIPPED,
    ERRORS,
    STUCK_OPS,
    SEALS,
    NODE_ERRORS,
    COMPRESS_RAW_BYTES,
    COMPRESS_STORED_BYTES,
    COMPRESS_SECONDS,
    WHATIF_HIT_TOKENS,
    CANARY,
    LOADS_DECLINED,
    FETCH_DEADLINE_MISSED,
    PRICED_FETCH_SECONDS,
    TIER_READ_BPS,
    TENANT_BYTES,
    TENANT_HIT_TOKENS,
    TENANT_LOOKUP_TOKENS,
    PINNED_BYTES,
    PREFILL_SPT,
    HANDOFF_CHUNKS,
    WARMUP_BYTES,
    WARMUP_SECONDS,
    WARMUP_HIT_TOKENS,
)


def exported_names(spec: MetricSpec) -> tuple[str, ...]:
    """The series names Prometheus shows for ``spec`` (counter ``_total``, histogram parts)."""
    if spec.kind == "counter":
        return (spec.name + "_total",)
    if spec.kind == "histogram":
        return tuple(spec.name + s for s in ("_bucket", "_sum", "_count"))
    return (spec.name,)
