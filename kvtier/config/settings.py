"""kvtier's one config: read once from ``kv_connector_extra_config`` plus
``KVTIER_<KEY>`` environment overrides, validated once, then frozen.

Every mistake raises :class:`~kvtier.errors.ConfigError` naming the key, the
value and what is allowed, so a wrong ``--kv-transfer-config`` stops the engine
at startup instead of misbehaving later.

This module is the config itself: which parser reads each key, the frozen
:class:`KVTierConfig` and :func:`load_config`. The parsers of single values live in
:mod:`kvtier.config.values` (sizes, numbers, text) and :mod:`kvtier.config.urls` (the
object tier's URLs); the public names the rest of kvtier reads are exported here and
from :mod:`kvtier.config`, where the rest of kvtier imports them.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from kvtier.config.tenants import parse_tenant, parse_tenant_list, parse_tenant_quotas
from kvtier.config.urls import CLUSTER_SCHEMES as CLUSTER_SCHEMES
from kvtier.config.urls import REMOTE_SCHEMES as REMOTE_SCHEMES
from kvtier.config.urls import RemoteKind as RemoteKind
from kvtier.config.urls import RemoteURL as RemoteURL
from kvtier.config.urls import cluster_seeds as cluster_seeds
from kvtier.config.urls import insecure_tls_args as insecure_tls_args
from kvtier.config.urls import parse_endpoint_url
from kvtier.config.urls import parse_remote as parse_remote
from kvtier.config.values import MAX_SIZE_BYTES as MAX_SIZE_BYTES
from kvtier.config.values import SIZE_HELP as SIZE_HELP
from kvtier.config.values import (
    describe_size,
    one_of,
    parse_bool,
    parse_cpu_bytes,
    parse_env_name,
    parse_float,
    parse_int,
    parse_int_or_auto,
    parse_path,
    parse_text,
)
from kvtier.config.values import format_size as format_size
from kvtier.config.values import parse_size as parse_size
from kvtier.errors import ConfigError, UnknownKeyError
from kvtier.redact import redact_setting
from kvtier.redact import redact_url as redact_url  # the tiers and the facade read it here

log = logging.getLogger("kvtier.config")

ENV_PREFIX = "KVTIER_"
WRITE_POLICIES = ("write_through", "write_back", "none")

#: the ``KVTIER_*`` variables that are not settings, and who reads them: the one list of
#: them. Every other ``KVTIER_*`` variable that names no setting is warned about at load
#: (a misspelt override, ignored). A name ending in ``*`` is a prefix. Not listed, and not
#: warned about either: whatever variable a ``*_env`` setting names (``hmac_key_env:
#: KVTIER_HMAC_KEY``), since that one holds the key.
NON_KEY_ENV: dict[str, str] = {
    "KVTIER_TEST_CPU_ISA": "make test: tests/isa_mask masks the CPU's AVX-512/AMX from torch",
    "KVTIER_TEST_SCENARIO_MODULES": "tests/e2e/engine.py: the scenario modules it loads",
    "KVTIER_TEST_*": "the test suite's other hooks and the key variables its engines read",
}

#: settings that turn authentication or encryption on: an empty value is a mistake (an
#: unset template variable, ``KVTIER_HMAC_KEY_ENV=""``), never a quiet way to switch it off
SECURITY_KEYS = ("hmac_key_env", "hmac_key_file", "encryption_key_env", "encryption_key_file")
#: every setting that names a key (the ones above and the rotation keys still accepted on
#: read): written as JSON ``null`` (a template rendering an unset value) or as ``""`` it is
#: refused, naming it; leaving the key out is how to run without it
KEY_SETTINGS = (
    *SECURITY_KEYS,
    "hmac_verify_keys_env",
    "hmac_verify_keys_file",
    "encryption_decrypt_keys_env",
    "encryption_decrypt_keys_file",
)
#: settings an empty ``KVTIER_<KEY>`` must not blank out when the JSON sets them
_NO_EMPTY_OVERRIDE = (*KEY_SETTINGS, "namespace")
#: settings that name an environment variable (which is then no typo of a setting)
ENV_NAME_KEYS = tuple(k for k in KEY_SETTINGS if k.endswith("_env"))
#: settings that take a size string ("8GiB", "8 GB"): how one was read is logged once
SIZE_KEYS = ("cpu_bytes", "cpu_headroom_bytes", "file_max_bytes", "warmup_bytes")
#: warm-up's share of the host tier when ``warmup_bytes`` is not set
WARMUP_SHARE = 0.5
#: what this process has logged already: a config is loaded several times per process
_ENV_WARNED: set[str] = set()
_SIZES_NOTED: set[tuple[str, str]] = set()


def redact_value(key: object, value: object) -> object:
    """A config value as a log line or report may show it (:func:`kvtier.redact.redact_setting`
    over the keys this config reads)."""
    return redact_setting(key, value, _PARSERS)


# Upper bounds keep every value usable: a timeout past threading.TIMEOUT_MAX raises
# OverflowError, a Redis expiry past int64 milliseconds is refused by the server.
_PARSERS: dict[str, Callable[[str, object], Any]] = {
    "chunk_size": lambda k, v: parse_int(k, v, 1, 2**20),
    "cpu_bytes": parse_cpu_bytes,
    "cpu_headroom_bytes": parse_size,
    "namespace": lambda k, v: parse_text(k, v) or "",
    "model_fingerprint": parse_text,
    "remote_url": parse_remote,  # a RemoteURL: load_config keeps it as ``remote``
    "s3_endpoint_url": parse_endpoint_url,
    "remote_ttl_s": lambda k, v: None if v is None else parse_int(k, v, 1, 2**31 - 1),
    "remote_tls_insecure": parse_bool,
    "file_max_bytes": lambda k, v: None if v is None else parse_size(k, v),
    "write_policy": one_of(WRITE_POLICIES),
    "lookup_timeout_ms": lambda k, v: parse_int(k, v, 1, 3_600_000),
    "shutdown_flush_s": lambda k, v: parse_float(k, v, 0.0, 86_400.0),
    "io_threads": parse_int_or_auto(1, 64),
    "inline_read_ms": lambda k, v: parse_int(k, v, 0, 10_000),
    "fetch_switch_us": lambda k, v: parse_int(k, v, 0, 1_000_000),
    "io_queue_depth": lambda k, v: parse_int(k, v, 1, 2**20),
    "hmac_key_env": parse_env_name,
    "hmac_key_file": parse_path,
    "hmac_verify_keys_env": parse_env_name,
    "hmac_verify_keys_file": parse_path,
    "encryption_key_env": parse_env_name,
    "encryption_key_file": parse_path,
    "encryption_decrypt_keys_env": parse_env_name,
    "encryption_decrypt_keys_file": parse_path,
    "trust_multimodal_ids": parse_bool,
    "whatif": parse_bool,
    "canary_first_hit": parse_bool,
    "canary_rate": lambda k, v: parse_float(k, v, 0.0, 1.0),
    "canary_check_tokens": lambda k, v: parse_int(k, v, 1, 2**31 - 1),
    "warmup": parse_bool,
    "warmup_bytes": lambda k, v: None if v is None else parse_size(k, v),
    "warmup_timeout_s": lambda k, v: parse_float(k, v, 0.0, 86_400.0),
}
#: how chunks are stored in the object tier: raw, compressed losslessly, losslessly only where
#: that makes reads faster, or as fp8 (kvtier.objects.compress)
COMPRESSIONS = ("none", "lossless", "auto", "fp8")
_PARSERS["compression"] = one_of(COMPRESSIONS)
#: whether object-tier lookups are priced against recomputing (kvtier.costs): "cost" asks
#: the tier only for the chunks predicted to arrive before vLLM would have computed them,
#: with a deadline; "always" loads whatever the tier holds, waiting up to lookup_timeout_ms
LOAD_POLICIES = ("cost", "always")
_PARSERS["load_policy"] = one_of(LOAD_POLICIES)
_PARSERS["load_margin"] = lambda k, v: parse_float(k, v, 0.1, 10.0)
# tenants (kvtier.host.tenants, kvtier.config.tenants): quotas and soft pins of the host tier
_PARSERS["default_tenant"] = parse_tenant
_PARSERS["pin_tenants"] = parse_tenant_list
_PARSERS["tenant_quotas"] = parse_tenant_quotas
_PARSERS["pin_max_fraction"] = lambda k, v: parse_float(k, v, 0.0, 1.0)
_PARSERS["tenant_metrics_max"] = lambda k, v: parse_int(k, v, 1, 1000)


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class KVTierConfig:
    """Validated connector settings. Build it with :func:`load_config`."""

    #: tokens per chunk; a multiple of vLLM's block size
    chunk_size: int = 256
    #: host tier size in bytes, or "auto" to let the planner size it
    cpu_bytes: int | Literal["auto"] = "auto"
    #: memory left to the OS and everything else when cpu_bytes is "auto"
    cpu_headroom_bytes: int = 4 * 2**30
    #: optional string mixed into every chunk key (tenant / deployment isolation)
    namespace: str = ""
    #: names the exact weights (a build id, a checksum) in object-tier keys instead of
    #: kvtier's own fingerprint of the model directory; for weights kvtier cannot read
    model_fingerprint: str | None = None
    #: object tier: file:///dir, s3://bucket/prefix, redis://host:port/db; None = host only
    remote_url: str | None = None
    #: ``remote_url`` read once (not a setting of its own): what the tiers, the engine and
    #: the store command ask of the URL (its kind, directory, bucket, seeds, TLS)
    remote: RemoteURL | None = field(default=None, compare=False)
    #: explicit S3 endpoint (MinIO, Ceph RGW); otherwise boto3's own discovery
    s3_endpoint_url: str | None = None
    #: expiry of chunks written to Redis, seconds; None = no expiry
    remote_ttl_s: int | None = None
    #: allow a rediss:// remote_url to turn off TLS verification (ssl_cert_reqs=none or
    #: optional, ssl_check_hostname=false); logged as a warning at startup
    remote_tls_insecure: bool = False
    #: size bound of a file:// tier: past it the least recently used chunks go (down to
    #: 90%); None = unbounded (the directory's own quota applies)
    file_max_bytes: int | None = None
    #: when chunks reach the object tier
    write_policy: str = "write_through"
    #: an object-tier lookup slower than this is a miss
    lookup_timeout_ms: int = 2000
    #: at shutdown, how long queued writes may still flush
    shutdown_flush_s: float = 10.0
    #: object-tier I/O threads (and the size of the connection pool), half of them for
    #: reads; "auto": :func:`auto_io_threads` of the CPUs this worker may run on
    io_threads: int | Literal["auto"] = "auto"
    #: a file:// tier on a local filesystem: how long the worker may read a lookup's first
    #: chunks itself in the step that starts it, before the I/O threads take the rest
    #: (that step is held up to this plus one chunk's read); 0 = always on the threads
    inline_read_ms: int = 20
    #: Python's thread switch interval while object-tier reads are in flight, so that
    #: the read threads get the GIL back quickly from a busy engine thread; 0 = leave it
    fetch_switch_us: int = 50
    #: queued object-tier writes before new ones are dropped (and counted)
    io_queue_depth: int = 256
    #: name of the environment variable holding the HMAC signing key
    hmac_key_env: str | None = None
    #: file holding the HMAC signing key
    hmac_key_file: str | None = None
    #: environment variable with extra comma-separated keys accepted on read (rotation)
    hmac_verify_keys_env: str | None = None
    #: file with extra keys accepted on read, one per line (rotation)
    hmac_verify_keys_file: str | None = None
    #: name of the environment variable holding the AES-256-GCM key that seals (encrypts)
    #: every chunk written to the object tier: 64 hex characters or base64 of 32 bytes
    encryption_key_env: str | None = None
    #: file holding the encryption key
    encryption_key_file: str | None = None
    #: environment variable with extra comma-separated keys that still decrypt (rotation)
    encryption_decrypt_keys_env: str | None = None
    #: file with extra keys that still decrypt, one per line (rotation)
    encryption_decrypt_keys_file: str | None = None
    #: share chunks of multimodal requests without a cache_salt through the object tier:
    #: only when no client can name an input (multi_modal_uuids) another client sent
    trust_multimodal_ids: bool = False
    #: object-tier chunks: "none" (raw), "lossless" (python-blosc2: byte shuffle + zstd) or
    #: "fp8" (lossy, opt-in: bf16/fp16 KV as fp8 e4m3 with per-block scales); every engine
    #: reads every form, whatever its own setting
    compression: str = "none"
    #: ghost host tiers at 0.5x to 8x cpu_bytes (chunk keys only): the hit rate more or
    #: less memory would give, as kvtier:whatif_hit_tokens (kvtier.whatif.host)
    whatif: bool = True
    #: a generation already in the object tier is trusted only once this engine computed
    #: chunks of it (canary_check_tokens) and found them equal to the stored ones
    #: (kvtier.canary); until then its lookups answer 0 and it stores nothing there, after a
    #: mismatch never again
    canary_first_hit: bool = True
    #: the fraction of later requests recomputed (no kvtier hit) and checked the same way
    canary_rate: float = 0.0
    #: tokens of computed chunks that must match before a generation of another engine is
    #: trusted (one chunk is thin evidence: weights can differ on some tokens only)
    canary_check_tokens: int = 1024
    #: a starting engine fetches its generation's hottest chunks (the manifest's hot list,
    #: kvtier.hotset) into its host tier before it serves (issue 61: the planner is
    #: kvtier.hotset.plan_warmup; the engine does not run it yet)
    warmup: bool = False
    #: how much warm-up may fetch; None: WARMUP_SHARE of the host tier (warmup_budget)
    warmup_bytes: int | None = None
    #: warm-up gives up after this long and the engine serves
    warmup_timeout_s: float = 60.0
    #: "cost": an object-tier lookup loads the leading chunks that shorten the request's
    #: predicted time to first token, and waits for them until a deadline (kvtier.costs);
    #: "always": every chunk the tier holds, waiting up to lookup_timeout_ms
    load_policy: str = "cost"
    #: how many times its recompute a load may take and still be worth it (1.0: load when
    #: no slower than recomputing; more loads more); also scales the fetch's deadline
    load_margin: float = 1.0
    #: the tenant of requests that name none in kv_transfer_params ({"kvtier": {"tenant":
    #: ...}}); None: they run untagged (under tenant_quotas' "*")
    default_tenant: str | None = None
    #: the tenants whose requests may soft-pin chunks ({"kvtier": {"pin_ttl_s": ...}}); "*":
    #: every tenant
    pin_tenants: tuple[str, ...] = ()
    #: host tier per worker each tenant may hold, ("*": each tenant not named): a tenant at
    #: its quota replaces its own oldest chunks, no store takes a chunk of a tenant within
    #: its quota (kvtier.host.tenants)
    tenant_quotas: tuple[tuple[str, int], ...] = ()
    #: the most of the host tier's slots soft pins may hold; the oldest pin yields first
    pin_max_fraction: float = 0.5
    #: tenants named on kvtier's tenant metrics; later ones are "other"
    tenant_metrics_max: int = 20

    @property
    def tenants(self) -> bool:
        """Whether tenants are on: quotas, pins, or a default tenant configured."""
        return bool(self.default_tenant or self.pin_tenants or self.tenant_quotas)

    def __post_init__(self) -> None:
        # load_config hands ``remote`` in; a config built or replaced otherwise reads its URL
        if (self.remote.text if self.remote else None) != (self.remote_url or None):
            object.__setattr__(self, "remote", parse_remote("remote_url", self.remote_url))

    def warmup_budget(self, host_bytes: int) -> int:
        """Bytes a warm start may fetch into a host tier of ``host_bytes``: ``warmup_bytes``
        (never more than the tier), else :data:`WARMUP_SHARE` of it; 0 without warm-up."""
        if not self.warmup:
            return 0
        if self.warmup_bytes is None:
            return int(host_bytes * WARMUP_SHARE)
        return min(self.warmup_bytes, host_bytes)

    def vllm_shutdown_timeout_s(self) -> int | None:
        """How long vLLM must give its engine on SIGTERM for the object-tier writes still
        queued to be written: ``shutdown_flush_s`` plus :data:`SHUTDOWN_MARGIN_S`, as
        vLLM's ``--shutdown-timeout`` and, where workers are processes of their own,
        ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``. vLLM's defaults (0 and 5 s) kill the
        engine at once, with the last requests' chunks still queued. None when nothing
        is written to an object tier."""
        if not self.remote_url or self.write_policy == "none":
            return None
        return math.ceil(self.shutdown_flush_s) + SHUTDOWN_MARGIN_S

    def io_thread_count(self, workers_on_node: int = 1) -> int:
        """``io_threads``, "auto" resolved for this process (:func:`auto_io_threads`)."""
        if self.io_threads != "auto":
            return self.io_threads
        return auto_io_threads(usable_cpus(), workers_on_node)

    def check_block_size(self, block_size: int) -> None:
        """Fail startup when chunks would not line up with vLLM's blocks."""
        if self.chunk_size % block_size != 0:
            raise ConfigError(
                "chunk_size",
                self.chunk_size,
                f"a multiple of the engine's block size ({block_size})",
            )

    def redacted(self) -> dict[str, Any]:
        """The config as a dict that is safe to log: no passwords, no key, not even its name.

        A key pasted into ``hmac_key_env`` is a valid variable name, so those
        values are hidden too; :func:`redact_value` says what is shown.
        """
        return {key: redact_value(key, getattr(self, key)) for key in KEYS}

    def __repr__(self) -> str:  # a config in a traceback or an f-string is logged too
        return f"KVTierConfig({', '.join(f'{k}={v!r}' for k, v in self.redacted().items())})"


#: seconds vLLM's engine needs at shutdown besides kvtier's flush (draining, its own
#: teardown, the worker processes' exit): see :meth:`KVTierConfig.vllm_shutdown_timeout_s`
SHUTDOWN_MARGIN_S = 10
#: vLLM's window for worker processes to exit at shutdown, which must cover kvtier's flush
VLLM_WORKER_SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
#: bounds of io_threads "auto": the fixed default's 4 (two read threads) on a small host,
#: and the 16 (eight read threads) that nearly halved a Llama-3-8B restart hit's reads on a
#: 16-core GPU host (docs/cuda.md, "On one NVIDIA H200"); more were not measured
AUTO_IO_THREADS = (4, 16)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_io_threads(cpus: int, workers_on_node: int = 1) -> int:
    """I/O threads for one worker: its share of the node's CPUs (``cpus`` over the
    ``workers_on_node`` that share them: the tensor-parallel ranks of one host), within
    :data:`AUTO_IO_THREADS`. Reads are mostly waits on a socket or a copy out of the page
    cache, so one thread per CPU; a restart hit's reads scale with them on a host with
    spare cores, and a small host keeps the 4 it always had."""
    low, high = AUTO_IO_THREADS
    return max(low, min(high, cpus // max(1, workers_on_node)))


#: the settings: every field but ``remote``, which is ``remote_url`` read
KEYS = tuple(f.name for f in fields(KVTierConfig) if f.name != "remote")
assert set(KEYS) == set(_PARSERS), "every config field needs a parser"


def secret_in_config(extra: Mapping[str, Any] | None) -> str | None:
    """What to warn about a secret written into ``kv_connector_extra_config`` itself, which
    vLLM logs verbatim (a password in ``remote_url``), or None. Overrides from the
    environment (``KVTIER_REMOTE_URL``) are not logged and not warned about."""
    url = extra.get("remote_url") if isinstance(extra, Mapping) else None
    if isinstance(url, str) and redact_url(url) != url:
        return (
            "remote_url in --kv-transfer-config holds a password, and vLLM logs that "
            "config verbatim; pass the URL through KVTIER_REMOTE_URL instead"
        )
    return None


def load_config(
    extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> KVTierConfig:
    """Validate ``kv_connector_extra_config`` and apply ``KVTIER_<KEY>`` overrides.

    Environment variables win over the dict, so an operator can change one
    setting of a packaged deployment without editing its JSON. Every mistake of the
    keys and values is found in one pass: the first is raised, the others ride on it
    (``ConfigError.more``) to be logged beside it. A ``KVTIER_*`` variable that names
    no setting is warned about, and how a decimal or spaced size was read is logged.
    """
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError("kv_connector_extra_config", extra, "a JSON object of kvtier settings")
    raw = dict(extra or {})
    env = os.environ if environ is None else environ
    # text keys first, in order; any other key (a number from YAML) after them
    unknown = sorted(
        (k for k in raw if k not in _PARSERS),
        key=lambda k: (k, "") if isinstance(k, str) else ("\uffff", type(k).__name__),
    )
    errors: list[ConfigError] = [unknown_key_error(k, raw.pop(k)) for k in unknown]
    for key in KEYS:
        env_value = env.get(ENV_PREFIX + key.upper())
        if env_value is None:
            continue
        if key in _NO_EMPTY_OVERRIDE and not env_value.strip() and raw.get(key):
            errors.append(
                ConfigError(
                    key,
                    f"{ENV_PREFIX}{key.upper()}=",
                    "an empty environment override would switch this setting off without a word; "
                    f"unset {ENV_PREFIX}{key.upper()}, or remove {key} from the config",
                )
            )
            continue
        raw[key] = env_value
    warn_unknown_env(env, raw)
    for key in KEY_SETTINGS:
        if key in raw and (raw[key] is None or isinstance(raw[key], str) and not raw[key].strip()):
            what = "null" if raw[key] is None else "empty"
            errors.append(
                ConfigError(
                    key,
                    raw.pop(key),
                    f"a name ({what} would turn it off silently); to run without it, leave it out",
                )
            )
    values: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            values[key] = _PARSERS[key](key, value)
        except ConfigError as exc:
            errors.append(exc)
    if errors:
        first = errors[0]
        first.more = tuple(errors[1:])
        raise first
    remote: RemoteURL | None = values.pop("remote_url", None)
    weak = remote.weak_tls if remote else ()
    if remote and weak and not values.get("remote_tls_insecure"):
        raise ConfigError(
            "remote_url",
            remote.text,
            f"{', '.join(weak)} turns off TLS verification of the server; remove it (give "
            "the server's CA with ssl_ca_certs=/path/ca.pem), or set remote_tls_insecure "
            "to true to allow it",
        )
    for kind in ("hmac", "encryption"):
        env_key, file_key = f"{kind}_key_env", f"{kind}_key_file"
        if values.get(env_key) and values.get(file_key):
            raise ConfigError(file_key, values[file_key], f"set {env_key} or {file_key}, not both")
    if values.get("file_max_bytes") is not None and not (remote and remote.is_local):
        raise ConfigError(
            "file_max_bytes",
            values["file_max_bytes"],
            "only with a file:// remote_url (S3 and Redis have their own expiry and limits)",
        )
    if values.get("warmup") and remote is None:
        raise ConfigError("warmup", values["warmup"], "a remote_url to warm the host tier from")
    note_sizes(raw, values)
    return KVTierConfig(**values, remote_url=remote.text if remote else None, remote=remote)


def unknown_key_error(key: object, value: object) -> UnknownKeyError:
    """The error for a key kvtier does not read: the nearest known key when one is close
    (``cpu_byte`` -> ``cpu_bytes``), else every key."""
    near = difflib.get_close_matches(key.lower(), KEYS, n=1) if isinstance(key, str) else []
    allowed = f"did you mean {near[0]!r}?" if near else "known keys are " + ", ".join(KEYS)
    return UnknownKeyError(key, value, allowed)


def is_known_non_key_env(name: str) -> bool:
    """Whether ``name`` is on :data:`NON_KEY_ENV` (by name, or under a ``*`` prefix)."""
    return name in NON_KEY_ENV or any(
        p.endswith("*") and name.startswith(p[:-1]) for p in NON_KEY_ENV
    )


def warn_unknown_env(env: Mapping[str, str], raw: Mapping[str, Any]) -> None:
    """Warn, once per process, of each ``KVTIER_*`` variable that names no setting: an
    override kvtier ignores (``KVTIER_CPU_BYTE``), with the nearest setting's variable.
    Its value is not shown: a key under a misspelt name is still a key. Exempt: the
    variables on :data:`NON_KEY_ENV`, and those the ``*_env`` settings in ``raw`` name."""
    settings = {ENV_PREFIX + k.upper() for k in KEYS}
    named = {raw[k] for k in ENV_NAME_KEYS if isinstance(raw.get(k), str)}
    for name in sorted(env):
        if (
            not name.startswith(ENV_PREFIX)
            or name in settings
            or name in named
            or name in _ENV_WARNED
            or is_known_non_key_env(name)
        ):
            continue
        _ENV_WARNED.add(name)
        near = difflib.get_close_matches(name.removeprefix(ENV_PREFIX).lower(), KEYS, n=1)
        if near:
            hint = f"; did you mean {ENV_PREFIX}{near[0].upper()}?"
        else:
            hint = f" (a setting's variable is {ENV_PREFIX} and its key in capitals)"
        log.warning(
            "kvtier: environment variable %s names no kvtier setting and is ignored%s", name, hint
        )


def note_sizes(raw: Mapping[str, object], values: Mapping[str, object]) -> None:
    """Log once per process how a size string one may misread was taken (``describe_size``:
    "8 GB" is 8,000,000,000 bytes, not 8 GiB)."""
    for key in SIZE_KEYS:
        text, n = raw.get(key), values.get(key)
        if not isinstance(text, str) or not isinstance(n, int) or (key, text) in _SIZES_NOTED:
            continue
        _SIZES_NOTED.add((key, text))
        if (line := describe_size(key, text, n)) is not None:
            log.info("kvtier: %s", line)
