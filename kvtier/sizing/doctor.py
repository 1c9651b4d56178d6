"""``kvtier doctor``: read a vLLM server log and say what weight offload and kvtier really did.

vLLM reports the UVA offload in GiB ("Total CPU offloaded parameters: 10.05")
and the prefetch offload in GB ("Total GPU memory saved: 10.7900 GB"), warns
about a discarded budget only through Python's ``warnings``, and logs nothing
when a selector matches nothing or an old V2 runner skips offload. The doctor
puts those lines side by side, converts each unit exactly, and raises the
same warning codes as ``kvtier size``.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from typing import Any

from kvtier.config import parse_size, redact_value
from kvtier.errors import ConfigError, is_secret_name, redact_text
from kvtier.sizing.memory_plan import OLDEST_OFFLOAD_SAFE_VLLM, GiB, parse_version, warning

GB = 10**9

_VERSION = [
    re.compile(r"vLLM (?:API )?server version (v?\d+\.\d+[\w.+-]*)"),
    re.compile(r"Initializing a V1 LLM engine \(v?(\d+\.\d+[\w.+-]*)\)"),
]
_OFFLOADER = re.compile(r"Offloader set to (\w+)")
_UVA_TOTAL = re.compile(r"Total CPU offloaded parameters: ([\d.]+)")
_PREFETCH = re.compile(
    r"\[PrefetchOffloader\] Initialized (\d+) modules\. Total GPU memory saved: ([\d.]+) GB, "
    r"Static buffer pool: ([\d.]+) GB \(group_size=(\d+), num_in_group=(\d+), "
    r"prefetch_step=(\d+)"
)
_MODEL_LOAD = re.compile(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) seconds")
_AVAIL_KV = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_KV_SIZE = re.compile(r"(\w+(?: \+ host)?) KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")
_CONNECTOR = re.compile(r"Creating v1 connector with name: (\w+)")
_KVTIER_CONFIG = re.compile(r"kvtier config: (\{.*\})\s*$")
#: kvtier's ConfigError, logged by kvtier or quoted in vLLM's traceback: a key's mistake
#: ("kvtier config 'chunk_size': got 0; ...") or an unknown key ("kvtier config: unknown
#: key 'cpu_byte': did you mean 'cpu_bytes'?"); the key may show as a placeholder
_KVTIER_ERROR = re.compile(r"(kvtier config(?: (?:'[^']*'|<[^>]*>|\S+): got |: unknown key ).*)$")
#: what pydantic appends to the error it wraps: "[type=value_error, input_value=...]"
_PYDANTIC_TAIL = re.compile(r" \[type=\w+.*$")
#: kvtier's startup warning (connectors/worker/shutdown.py) that vLLM's stop cuts its flush short
_KVTIER_SHUTDOWN = re.compile(r"kvtier: (vLLM's .* object-tier writes still queued .*)$")
#: kvtier's warning (connectors/scheduler/lookup.py SLOW_TIER_MSG) that the object tier is slower
#: than this engine's prefill
_SLOW_TIER = re.compile(r"kvtier: (the object tier reads .* slower than computing them.*)$")
#: kvtier's refusal of recurrent state held in another mode (connectors/groups.py)
_STATE_MODE = re.compile(r"Mamba/SSM state.*mamba_cache_mode \[([^\]]*)\]")
#: kvtier's once-logged warning that a chunk with recurrent state was not stored
#: (connectors/scheduler/plans.py STATE_STEP_HINT)
_STATE_STEP = re.compile(
    r"kvtier: chunk \d+ of a request with recurrent state .* ends at token (\d+), but the "
    r"step that completed it ran on to token (\d+)"
)
_NUM_IN_GROUP = re.compile(
    r"offload_num_in_group \((\d+)\) must be <= offload_group_size \((\d+)\)"
)
#: the host ran out of memory: an allocation refused (kvtier's mmap, torch, numpy) or the
#: kernel's OOM killer at work (its dmesg lines, when those are in the file too)
_HOST_OOM = re.compile(
    r"Cannot allocate memory|\bMemoryError\b|std::bad_alloc|Out of memory: Kill|oom-kill|"
    r"invoked oom-killer|oom_reaper"
)
_GPU_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
#: a vLLM process that died: vLLM 0.32's executor ("Worker proc VllmWorker-0 died
#: unexpectedly (exit code: None)", None when the process was gone before vLLM could read
#: its status, as after SIGKILL), its engine-core monitor ("Engine core initialization
#: failed. ... Failed core proc(s): {'EngineCore_DP0': -9}", "Process EngineCore_DP0
#: (PID: 7) died with exit code -9", "engine core exited unexpectedly")
_DIED = re.compile(
    r"died unexpectedly|died with exit code|exited unexpectedly|"
    r"Engine core initialization failed"
)
_EXIT_CODE = re.compile(r"exit code:? (-?\d+|None)|'\w+': (-?\d+)")
#: killed for certain: SIGKILL named, or a shell's "Killed", or the kernel's own line
_SIGKILL = re.compile(
    r"\bsignal 9\b|\bSIGKILL\b|^Killed\b|: Killed\b|\b\d+ Killed\s|Killed process \d+"
)
#: an error a worker logged itself (a traceback of its own): its death was not a kill
_WORKER_ERROR = re.compile(r"\((?:Worker|VllmWorker)[^)]*\) ERROR ")
#: a line in vLLM's log format ("INFO 11-22 09:00:00 [file.py:12] ..."), with or without
#: the "(APIServer pid=1)" prefix: what tells a vLLM log from other input
_VLLM_LINE = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d")
#: the most lines of one kind a report quotes
_QUOTED = 3
#: the longest cause of a failed start the report quotes
_CAUSE_CHARS = 300

# ---- did the server start? -------------------------------------------------------------
#: where a run of ``vllm serve`` begins (a container's log may hold several)
_NEW_RUN = _NON_DEFAULT
#: a line of vLLM's API server (a log of the offline engine has none)
_SERVER_LINE = re.compile(r"\(APIServer pid=|vLLM (?:API )?server version|non-default args: ")
#: the server is up and listening (vLLM's own line, then uvicorn's)
_SERVER_UP = re.compile(r"Starting vLLM (?:API )?server|Application startup complete")
#: the engine is up: what tells an offline engine's log that it started
_ENGINE_UP = "init engine ("
#: vLLM's prefix of a line: "(EngineCore pid=8) ERROR 12-06 10:00:03 [core.py:1510] "
_PREFIX = re.compile(
    r"(?:\([^)]*\)\s+)?(?:(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d "
    r"\d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\]\s?)?"
)
#: the last line of a Python traceback: the exception's (qualified) name and message
_EXCEPTION = re.compile(
    r"(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Exit)|Exception|KeyboardInterrupt)"
    r"(?::\s.*)?"
)
#: what pydantic says under its ValidationError: the error vLLM's own validation raised
_PYDANTIC_ERROR = re.compile(r"\s*(?:Value error|Assertion failed), (.*)")
#: an exception that only passes another one on ("See root cause above"): the cause of
#: last resort, after every other error of the run
_WRAPPER = re.compile(
    r"root cause|See stack trace|EngineDeadError|Executor failed|encountered an issue|"
    r"initialization failed|failed to start|ValidationError"
)
_BOTH_SET = "Both UVA and prefetch offload fields are set"
_UVA_IGNORED = "UVA offload fields are set but offload_backend='prefetch'"
_PREFETCH_IGNORED = "Prefetch offload fields are set but offload_backend='uva'"
_V2_RUNNER = "Using V2 Model Runner"

_ARG_KEYS = {
    "cpu_offload_gb": re.compile(r"'cpu_offload_gb': ([\d.]+)"),
    "offload_group_size": re.compile(r"'offload_group_size': (\d+)"),
    "offload_num_in_group": re.compile(r"'offload_num_in_group': (\d+)"),
    "offload_prefetch_step": re.compile(r"'offload_prefetch_step': (\d+)"),
    "offload_backend": re.compile(r"'offload_backend': '(\w+)'"),
    "cpu_offload_params": re.compile(r"'cpu_offload_params': (\{[^}]*\}|\[[^\]]*\])"),
    "offload_params": re.compile(r"'offload_params': (\{[^}]*\}|\[[^\]]*\])"),
    "model": re.compile(r"'model': '([^']*)'"),
    "tensor_parallel_size": re.compile(r"'tensor_parallel_size': (\d+)"),
}


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None


def _non_default_args(text: str) -> dict[str, Any]:
    """The offload-relevant entries of vLLM's ``non-default args`` dict.

    Parsed key by key: the dict's repr holds objects (KVTransferConfig(...)) that
    ``literal_eval`` cannot read.
    """
    out: dict[str, Any] = {}
    for key, rx in _ARG_KEYS.items():
        m = rx.search(text)
        if not m:
            continue
        raw = m.group(1)
        if key in ("cpu_offload_params", "offload_params"):
            value = _literal(raw)
            out[key] = sorted(value) if isinstance(value, set | list) else []
        elif key in ("offload_backend", "model"):
            out[key] = raw
        elif key == "cpu_offload_gb":
            out[key] = float(raw)
        else:
            out[key] = int(raw)
    if "KVTierConnector" in text:
        out["kv_connector"] = "KVTierConnector"
        if m := re.search(r"kv_load_failure_policy='(\w+)'", text):
            out["kv_load_failure_policy"] = m.group(1)
        m = re.search(r"kv_connector_extra_config=(\{[^{}]*\})", text)
        extra = _literal(m.group(1)) if m else None
        if isinstance(extra, dict):  # vLLM logs it verbatim: hide passwords and keys again
            out["kv_connector_extra_config"] = safe_config(extra)
    return out


def safe_config(config: object) -> object:
    """A logged kvtier config as the doctor may print it: no password, key or key name.

    The log may come from any kvtier version, or from vLLM, which prints the
    extra config verbatim; everything printed goes through the same redaction
    as ``KVTierConfig.redacted``.
    """
    if isinstance(config, dict):
        return {str(k): redact_value(k, v) for k, v in config.items()}
    return redact_value("kvtier_config", config)


_STRING_REPR = re.compile(r"'(?:[^'\\]|\\.)*'" + r'|"(?:[^"\\]|\\.)*"')


def safe_error(line: str) -> str:
    """A logged ConfigError line without secrets, even one an older kvtier wrote unredacted."""
    m = re.match(r"(kvtier config '(\w+)': got )(.*)$", line, re.S)
    if m and is_secret_name(m.group(2)):  # hide the whole value repr, whatever it holds
        rest = m.group(3)
        v = _STRING_REPR.match(rest)
        end = v.end() if v else (rest.find("; ") if "; " in rest else len(rest))
        line = m.group(1) + "<redacted>" + rest[end:]
    return redact_text(line)


def parse_log(lines: Iterable[str]) -> dict[str, Any]:
    """Everything the doctor reads from a log, as facts (no judgement yet)."""
    facts: dict[str, Any] = {
        "vllm_version": None,
        "v2_model_runner": False,
        "offloader": None,
        "args": {},
        "uva_offloaded_gib": None,
        "prefetch": None,
        "model_loading_gib": None,
        "available_kv_cache_gib": None,
        "kv_cache_pool": None,
        "kv_cache_tokens": None,
        "max_model_len": None,
        "max_concurrency": None,
        "connector": None,
        "kvtier_config": None,
        "kvtier_errors": [],
        "python_warnings": [],
        "offload_validation_error": None,
        "kvtier_shutdown": None,
        "slow_tier": None,
        "host_oom": [],
        "gpu_oom": [],
        "died": [],
        "exit_codes": [],
        "sigkill": False,
        "worker_error": False,
        "vllm_lines": 0,
        "state_mode": None,
        "state_step": None,
        "started": False,
        "startup_failure": None,
    }
    startup = _Startup()
    for line in lines:
        line = line.rstrip("\n")
        startup.read(line)
        if _VLLM_LINE.search(line):
            facts["vllm_lines"] += 1
        for key, rx in (("host_oom", _HOST_OOM), ("gpu_oom", _GPU_OOM), ("died", _DIED)):
            if rx.search(line) and len(facts[key]) < _QUOTED:
                facts[key].append(safe_error(line.strip())[:300])
        if _DIED.search(line):
            facts["exit_codes"] += [a or b for a, b in _EXIT_CODE.findall(line)]
        if _SIGKILL.search(line.strip()):
            facts["sigkill"] = True
            if len(facts["died"]) < _QUOTED and not _DIED.search(line):
                facts["died"].append(safe_error(line.strip())[:300])
        if _WORKER_ERROR.search(line):
            facts["worker_error"] = True
        if facts["vllm_version"] is None:
            for rx in _VERSION:
                if m := rx.search(line):
                    facts["vllm_version"] = m.group(1).lstrip("v").rstrip(",")
                    break
        if _V2_RUNNER in line:
            facts["v2_model_runner"] = True
        if m := _OFFLOADER.search(line):
            facts["offloader"] = m.group(1)
        if m := _UVA_TOTAL.search(line):
            facts["uva_offloaded_gib"] = float(m.group(1))
        if m := _PREFETCH.search(line):
            facts["prefetch"] = {
                "modules": int(m.group(1)),
                "gpu_saved_gb": float(m.group(2)),
                "buffer_pool_gb": float(m.group(3)),
                "group_size": int(m.group(4)),
                "num_in_group": int(m.group(5)),
                "prefetch_step": int(m.group(6)),
            }
        if m := _MODEL_LOAD.search(line):
            facts["model_loading_gib"] = float(m.group(1))
        if m := _AVAIL_KV.search(line):
            facts["available_kv_cache_gib"] = float(m.group(1))
        if m := _KV_SIZE.search(line):
            facts["kv_cache_pool"] = m.group(1)
            facts["kv_cache_tokens"] = int(_num(m.group(2)))
        if m := _CONCURRENCY.search(line):
            facts["max_model_len"] = int(_num(m.group(1)))
            facts["max_concurrency"] = float(m.group(2))
        if m := _NON_DEFAULT.search(line):
            facts["args"] = _non_default_args(m.group(1))
        if m := _CONNECTOR.search(line):
            facts["connector"] = m.group(1)
        if m := _KVTIER_CONFIG.search(line):
            text = m.group(1)
            try:
                config = json.loads(text)
            except json.JSONDecodeError:
                config = _literal(text)
            facts["kvtier_config"] = safe_config(config)
        if m := _KVTIER_SHUTDOWN.search(line):
            facts["kvtier_shutdown"] = m.group(1)
        if m := _SLOW_TIER.search(line):
            facts["slow_tier"] = m.group(1)  # the last one: the tier as it was last seen
        if (m := _KVTIER_ERROR.search(line)) and (err := kvtier_error(m.group(1))) not in facts[
            "kvtier_errors"
        ]:  # logged by kvtier, then quoted by vLLM
            facts["kvtier_errors"].append(err)
        for marker in (_BOTH_SET, _UVA_IGNORED, _PREFETCH_IGNORED):
            if marker in line and marker not in facts["python_warnings"]:
                facts["python_warnings"].append(marker)
        if facts["state_mode"] is None and (m := _STATE_MODE.search(line)):
            facts["state_mode"] = m.group(1).replace("'", "")
        if facts["state_step"] is None and (m := _STATE_STEP.search(line)):
            facts["state_step"] = (int(m.group(1)), int(m.group(2)))
        if m := _NUM_IN_GROUP.search(line):
            facts["offload_validation_error"] = (int(m.group(1)), int(m.group(2)))
    facts["started"], facts["startup_failure"] = startup.started, startup.cause()
    return facts


def kvtier_error(text: str) -> str:
    """A logged ConfigError as the doctor quotes it: no secret, no pydantic tail."""
    return safe_error(_PYDANTIC_TAIL.sub("", text.strip()))


class _Startup:
    """Whether the last run of the server in a log came up, and if not, the one line that
    says why: kvtier's own config error first, then the first error of the run that is
    not only a wrapper of another ("See root cause above"), then the host or GPU out of
    memory, a process that died, and last such a wrapper. Errors after the server came
    up are another matter (the other warnings); a new run starts the watch over."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.server = self.server_up = self.engine_up = False
        self.kvtier: list[str] = []
        self.errors: list[str] = []
        self.memory: list[str] = []
        self.died: list[str] = []
        self.wrappers: list[str] = []

    @property
    def started(self) -> bool:
        """The server listens, or (a log of the offline engine) the engine came up."""
        return self.server_up or (self.engine_up and not self.server)

    def read(self, line: str) -> None:
        if _NEW_RUN.search(line):
            self._reset()
        if _SERVER_LINE.search(line):
            self.server = True
        if _SERVER_UP.search(line):
            self.server_up = True
        if _ENGINE_UP in line:
            self.engine_up = True
        prefix = _PREFIX.match(line)
        level = prefix.group(1) if prefix else None
        if self.started or level not in (None, "ERROR", "CRITICAL"):
            return
        body = line[prefix.end() if prefix else 0 :].strip()
        if m := _KVTIER_ERROR.search(line):
            self.kvtier.append(kvtier_error(m.group(1)))
        elif m := _PYDANTIC_ERROR.fullmatch(body):
            self.errors.append(_PYDANTIC_TAIL.sub("", m.group(1)))
        elif _EXCEPTION.fullmatch(body):
            if _WRAPPER.search(body):  # ("Engine core initialization failed": not a death)
                self.wrappers.append(body)
                return
            self.errors.append(body)
        if _HOST_OOM.search(line) or _GPU_OOM.search(line):
            self.memory.append(body)
        if _DIED.search(line) or _SIGKILL.search(line.strip()):
            self.died.append(body)

    def cause(self) -> str | None:
        """The one line naming why the last run did not start; None when it started or
        the log shows no error (it may have been cut before the server came up)."""
        if self.started:
            return None
        for found in (self.kvtier, self.errors, self.memory, self.died, self.wrappers):
            if found:
                cause = _safe_cause(found[0])
                return cause if len(cause) <= _CAUSE_CHARS else cause[: _CAUSE_CHARS - 3] + "..."
        return None


def _safe_cause(line: str) -> str:
    """``line`` without secrets. An exception's name is kept as it is: redaction takes a
    CamelCase name (``torch.OutOfMemoryError``) for a generated token."""
    name, sep, message = line.partition(": ")
    if sep and _EXCEPTION.fullmatch(name):
        return f"{name}: {safe_error(message)}"
    return safe_error(line)


def read_anything(facts: dict[str, Any]) -> bool:
    """Whether the input was a log the doctor can speak about: some line in vLLM's log
    form, or a memory or process error (a container's output without vLLM's logger)."""
    return bool(
        facts["vllm_lines"]
        or facts["host_oom"]
        or facts["gpu_oom"]
        or facts["died"]
        or facts["sigkill"]
        or facts["kvtier_errors"]
        or facts["vllm_version"]
    )


def read_proc_status(pid: int) -> dict[str, int]:
    """VmRSS and RssShmem of a live process, in bytes (Linux /proc)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssShmem", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def diagnose(facts: dict[str, Any]) -> list[dict[str, str]]:
    """Turn the facts into warnings with the same codes ``kvtier size`` uses."""
    w: list[dict[str, str]] = []
    if facts["startup_failure"]:
        w.append(warning("startup-failed", f"the server did not start: {facts['startup_failure']}"))
    args = facts["args"]
    gb = float(args.get("cpu_offload_gb", 0) or 0)
    group = int(args.get("offload_group_size", 0) or 0)
    backend = args.get("offload_backend", "auto")
    requested = gb > 0 or group > 0 or backend in ("uva", "prefetch")
    applied = facts["offloader"] is not None and facts["offloader"] != "NoopOffloader"
    version = parse_version(facts["vllm_version"])

    if _BOTH_SET in facts["python_warnings"] or (backend == "auto" and gb > 0 and group > 0):
        w.append(
            warning(
                "uva-discarded-by-prefetch",
                (
                    f"--cpu-offload-gb {gb:g} was discarded: --offload-group-size {group} selects "
                    "the prefetch backend, and vLLM said so only through a Python warning."
                ),
            )
        )
    if _UVA_IGNORED in facts["python_warnings"]:
        w.append(
            warning(
                "uva-discarded-by-prefetch",
                "--offload-backend prefetch ignored the UVA (--cpu-offload-gb) fields.",
            )
        )
    if _PREFETCH_IGNORED in facts["python_warnings"]:
        w.append(
            warning("prefetch-ignored-by-uva", "--offload-backend uva ignored the prefetch fields.")
        )
    if err := facts["offload_validation_error"]:
        code = "prefetch-without-group-size" if err[1] == 0 else "prefetch-invalid"
        w.append(
            warning(
                code,
                (
                    f"vLLM refused the offload config: offload_num_in_group ({err[0]}) must be <= "
                    f"offload_group_size ({err[1]})"
                    + (
                        "; --offload-backend prefetch needs --offload-group-size"
                        if err[1] == 0
                        else ""
                    )
                    + "."
                ),
            )
        )
    if requested and not applied and facts["offload_validation_error"] is None:
        old = version is not None and version[:2] < OLDEST_OFFLOAD_SAFE_VLLM
        if old:
            w.append(
                warning(
                    "offload-ignored-old-vllm",
                    (
                        f"weight offload was requested but vLLM {facts['vllm_version']} "
                        + ("runs the V2 model runner, which " if facts["v2_model_runner"] else "")
                        + "ignores it silently: all weights stayed on the GPU. Upgrade to >= 0.28."
                    ),
                )
            )
        else:
            w.append(
                warning(
                    "offload-not-applied",
                    (
                        "weight offload was requested but the log shows no offloader "
                        "(no 'Offloader set to ...' line); check the log covers engine start."
                    ),
                )
            )
    if facts["offloader"] == "UVAOffloader" or (applied and gb > 0 and group == 0):
        if args.get("offload_params"):
            w.append(
                warning(
                    "offload-params-ignored",
                    (
                        f"offload_params {args['offload_params']} is read only by the prefetch "
                        "backend; UVA used cpu_offload_params "
                        f"{args.get('cpu_offload_params') or '(none: everything eligible)'}."
                    ),
                )
            )
        if facts["uva_offloaded_gib"] is None:
            sel = args.get("cpu_offload_params")
            w.append(
                warning(
                    "selector-matches-nothing",
                    (
                        f"the UVA offloader was set but offloaded nothing; selectors {sel} match "
                        "no parameter name (matched as '.sel.' inside names relative to a decoder "
                        "layer, e.g. 'experts', 'self_attn', not 'layers.0' or 'model.layers...')."
                    ),
                )
            )
        elif gb > 0 and facts["uva_offloaded_gib"] < gb - 0.01:
            w.append(
                warning(
                    "cpu-offload-gb-not-kv",
                    (
                        f"--cpu-offload-gb {gb:g} but vLLM offloaded {facts['uva_offloaded_gib']} "
                        "GiB: the rest of the budget does nothing. It moves weights only, never KV "
                        "cache."
                    ),
                )
            )
    if args.get("kv_connector") == "KVTierConnector" and (
        args.get("kv_load_failure_policy") == "fail"
    ):
        w.append(
            warning(
                "kv-load-failure-fails-requests",
                (
                    "kv_load_failure_policy is 'fail' (vLLM's default): a chunk that fails to load "
                    "(a host-tier copy error, a chunk spoiled after its lookup) fails its request "
                    "instead of being recomputed, and a local directory tier's lookups take an "
                    'engine step of their own. Add "kv_load_failure_policy": "recompute" to '
                    "--kv-transfer-config (`kvtier size --emit kv-transfer-config` prints it)."
                ),
            )
        )
    if facts["state_mode"] is not None:
        w.append(
            warning(
                "state-needs-align-mode",
                (
                    "the model has recurrent state (Mamba/SSM, gated delta-net), held with "
                    f"mamba_cache_mode {facts['state_mode']}: vLLM keeps a state at every block "
                    "boundary only with --mamba-cache-mode align, and kvtier stores the state at "
                    "each chunk's end. Add --enable-prefix-caching --mamba-cache-mode align, and "
                    "chunked prefill with --max-num-batched-tokens equal to vLLM's block size "
                    "(`kvtier size --emit vllm-args` prints them)."
                ),
            )
        )
    if facts["state_step"] is not None:
        end, ran = facts["state_step"]
        w.append(
            warning(
                "state-chunks-not-stored",
                (
                    f"a chunk ending at token {end} was not stored: the prefill step that "
                    f"completed it ran on to token {ran}, and the state at the chunk's end was not "
                    "kept. Every chunk end must end a prefill step: --enable-chunked-prefill "
                    "--max-num-batched-tokens equal to vLLM's block size (logged as 'kv lcm block "
                    "sizes'; vLLM's CPU build needs it for these models anyway) or to chunk_size."
                ),
            )
        )
    if facts["kvtier_shutdown"]:
        w.append(warning("shutdown-loses-queued-writes", facts["kvtier_shutdown"]))
    if facts["slow_tier"]:
        w.append(warning("tier-slower-than-prefill", facts["slow_tier"]))
    w += _memory_warnings(facts)
    if facts["offloader"] == "PrefetchOffloader" and args.get("cpu_offload_params"):
        w.append(
            warning(
                "offload-params-ignored",
                (
                    f"cpu_offload_params {args['cpu_offload_params']} is read only by UVA; "
                    "prefetch reads offload_params."
                ),
            )
        )
    return w


def _memory_warnings(facts: dict[str, Any]) -> list[dict[str, str]]:
    """Out of memory and killed processes: the engine stopped, and the log's last lines
    (a traceback of the API server) rarely say why."""
    w: list[dict[str, str]] = []
    host_hint = (
        "Host RAM must hold vLLM itself, its CPU KV cache (VLLM_CPU_KVCACHE_SPACE on the CPU "
        "build) and kvtier's host tier (cpu_bytes per worker, plus cpu_headroom_bytes): lower "
        "cpu_bytes or VLLM_CPU_KVCACHE_SPACE, or run `kvtier size --host-memory GiB` for a "
        "plan that fits."
    )
    if facts["host_oom"]:
        w.append(
            warning(
                "host-out-of-memory",
                (f"the host ran out of memory: {facts['host_oom'][0]!r}. " + host_hint),
            )
        )
    if facts["gpu_oom"]:
        w.append(
            warning(
                "gpu-out-of-memory",
                (
                    f"the GPU ran out of memory: {facts['gpu_oom'][0]!r}. Lower "
                    "--gpu-memory-utilization, --max-model-len or --max-num-seqs, or offload "
                    "weights (`kvtier size` plans them)."
                ),
            )
        )
    codes = facts["exit_codes"]
    # -9 is SIGKILL; None: the process was gone before vLLM read its status, which is how a
    # SIGKILLed worker shows in vLLM 0.32, unless the worker logged an error of its own
    killed = (
        facts["sigkill"]
        or "-9" in codes
        or (
            facts["died"]
            and not facts["worker_error"]
            and any(c == "None" or c.startswith("-") for c in codes)
        )
    )
    if killed:
        w.append(
            warning(
                "worker-killed",
                (
                    f"a vLLM process was killed: {(facts['died'] or ['-'])[0]!r} (exit code "
                    f"{', '.join(dict.fromkeys(codes)) or 'not logged'}). Exit code -9 is SIGKILL, "
                    "and None a process gone before vLLM could read how it ended, with no error of "
                    "its own in the log: nothing in vLLM or kvtier kills its workers; the kernel's "
                    "OOM killer does when the host runs out of memory (see `dmesg`, or the "
                    "container's OOMKilled status). " + host_hint
                ),
            )
        )
    elif facts["died"]:
        w.append(
            warning(
                "worker-died",
                (
                    f"a vLLM process died: {facts['died'][0]!r}; the error logged before it is the "
                    "cause."
                ),
            )
        )
    return w


def config_cpu_bytes(cfg: object) -> int | None:
    """The logged ``cpu_bytes`` in bytes, read with kvtier's own size parser ("2GiB",
    "512MiB", a byte count); None for "auto" or a value kvtier would refuse."""
    value = cfg.get("cpu_bytes") if isinstance(cfg, dict) else None
    if value is None or value == "auto":
        return None
    try:
        return parse_size("cpu_bytes", value)
    except ConfigError:
        return None


def expected_host_bytes(facts: dict[str, Any], plan: dict[str, Any] | None) -> int | None:
    """Host RAM one worker should hold for offloaded weights + the kvtier slab, per the plan.

    The slab is the ``cpu_bytes`` kvtier logged (a byte count or a size string such as
    "2GiB"), else the plan's tier.
    """
    if plan is None:
        return None
    slab = config_cpu_bytes(
        facts.get("kvtier_config") or facts["args"].get("kv_connector_extra_config")
    )
    if slab is None:
        slab = plan["host_tier_bytes"] or 0
    return int(plan["weight_offload_host_bytes"]) + slab


def report(
    facts: dict[str, Any], proc: dict[str, int] | None = None, plan: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON the doctor prints: facts, converted sizes, process memory, plan, warnings."""
    out = dict(facts)
    gib = facts["uva_offloaded_gib"]
    out["uva_offloaded_bytes"] = None if gib is None else round(gib * GiB)
    if facts["prefetch"]:
        pf = dict(facts["prefetch"])
        pf["gpu_saved_bytes"] = round(pf["gpu_saved_gb"] * GB)
        pf["buffer_pool_bytes"] = round(pf["buffer_pool_gb"] * GB)
        pf["gpu_saved_gib"] = round(pf["gpu_saved_gb"] * GB / GiB, 4)
        out["prefetch"] = pf
    out["kvtier_loaded"] = facts["connector"] == "KVTierConnector" or (
        facts["args"].get("kv_connector") == "KVTierConnector"
    )
    if out["kvtier_config"] is None and "kv_connector_extra_config" in facts["args"]:
        out["kvtier_config"] = facts["args"]["kv_connector_extra_config"]
    out["process"] = proc
    out["plan"] = plan
    out["expected_host_bytes"] = expected_host_bytes(facts, plan)
    warns = diagnose(facts)
    if plan:
        seen = {x["code"] for x in warns}
        warns += [x for x in plan["warnings"] if x["code"] not in seen]
    out["warnings"] = warns
    return out


def format_report(rep: dict[str, Any]) -> str:
    """The readable form of :func:`report`."""

    def row(label: str, value: Any) -> str:
        return f"  {label:<30} {'-' if value is None else value}"

    pf = rep["prefetch"]
    gib = rep["uva_offloaded_gib"]
    failure = rep["startup_failure"]  # the one line that matters, before everything else
    lines = [f"the server did not start: {failure}"] if failure else []
    lines += [
        "vLLM",
        row("version", rep["vllm_version"]),
        row("V2 model runner", "yes" if rep["v2_model_runner"] else "not logged"),
        row("offloader", rep["offloader"] or "none logged"),
        row(
            "requested (non-default args)",
            {k: v for k, v in rep["args"].items() if k != "model"} or None,
        ),
        row(
            "UVA offloaded (vLLM prints GiB)",
            None if gib is None else f"{gib} GiB = {rep['uva_offloaded_bytes'] / GB:.2f} GB",
        ),
    ]
    if pf:
        lines.append(
            row(
                "prefetch saved (prints GB)",
                f"{pf['gpu_saved_gb']} GB = {pf['gpu_saved_gib']} GiB ({pf['modules']} layers)",
            )
        )
        lines.append(row("prefetch buffer pool", f"{pf['buffer_pool_gb']} GB"))
    lines += [
        row(
            "model loading",
            None if rep["model_loading_gib"] is None else f"{rep['model_loading_gib']} GiB",
        ),
        row(
            "available KV cache",
            None
            if rep["available_kv_cache_gib"] is None
            else f"{rep['available_kv_cache_gib']} GiB",
        ),
        row(
            "KV cache capacity",
            None
            if rep["kv_cache_tokens"] is None
            else f"{rep['kv_cache_tokens']:,} tokens ({rep['kv_cache_pool']})",
        ),
        row(
            "max concurrency",
            None
            if rep["max_concurrency"] is None
            else f"{rep['max_concurrency']}x at {rep['max_model_len']:,} tokens",
        ),
        "kvtier",
        row("loaded", "yes" if rep["kvtier_loaded"] else "no"),
        row("config", rep["kvtier_config"]),
    ]
    for err in rep["kvtier_errors"]:
        lines.append(row("error", err))
    if rep["process"]:
        p = rep["process"]
        lines.append("process")
        for key in ("VmRSS", "RssShmem", "RssAnon"):
            if key in p:
                lines.append(row(key, f"{p[key] / GiB:.2f} GiB"))
    if rep["plan"]:
        plan = rep["plan"]
        lines.append("plan")
        exp = rep["expected_host_bytes"]
        lines.append(
            row(
                "expected host bytes / worker",
                f"{exp / GiB:.2f} GiB (offloaded weights + kvtier slab)",
            )
        )
        if rep["process"] and "VmRSS" in rep["process"]:
            rss = rep["process"]["VmRSS"]
            lines.append(
                row(
                    "VmRSS vs plan",
                    f"{rss / GiB:.2f} GiB vs {exp / GiB:.2f} GiB "
                    "(RSS also holds Python, CUDA context and untouched-slab effects)",
                )
            )
        if gib is not None:
            lines.append(
                row(
                    "logged vs planned UVA",
                    f"{gib} GiB vs {plan['weight_offload_gpu_bytes'] / GiB:.2f} GiB",
                )
            )
        lines.append(
            row(
                "planned weight offload",
                f"{plan['weight_offload_gpu_bytes'] / GiB:.2f}"
                f" GiB off GPU, {plan['weight_offload_host_bytes'] / GiB:.2f} GiB host",
            )
        )
    lines.append("warnings" if rep["warnings"] else "warnings: none")
    for x in rep["warnings"]:
        lines.append(f"  [{x['code']}] {x['message']}")
    return "\n".join(lines)
