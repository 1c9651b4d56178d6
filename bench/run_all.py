"""``make bench``: kvtier against vLLM alone, ExampleConnector and LMCache, in one run.

One model (random-weight Llama, 8 layers, 1024 wide), one machine, vLLM's CPU
build, the same workloads for every configuration, driven through
``kvtier bench`` (``kvtier.cli.bench``) over each server's OpenAI API:

1. a repeated 2,048-token prompt: cold (distinct prompts), in-engine hit (the
   same prompt again), connector hit (the same prompt with vLLM's own prefix
   cache reset before each request, so only the connector can supply it), and,
   for peers whose cache outlives vLLM, a hit after restarting vLLM;
2. prompts that share 75 % of their tokens (prefix cache reset before each);
3. multi-turn chat sessions, interleaved, with a device KV cache far smaller
   than the sessions' histories.

Every configuration gets the same ``--kv-cache-memory-bytes`` (the byte-exact
form of ``VLLM_CPU_KVCACHE_SPACE``, which only takes whole GiB — 65,536 tokens
of this model, more than these workloads can fill in minutes on two cores).
Ratios are printed and written with plots to ``bench/results/``. A peer that
cannot run here is reported as "unavailable: <reason>" and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import report
from harness import Unavailable, VLLMServer

from kvtier.cli import bench
from kvtier.sizing.autosize import mem_available_bytes
from kvtier.sizing.emit import shutdown_flags

HERE = Path(__file__).resolve().parent

SHAPES = {
    "bench": {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8},
    "tiny": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2},  # smoke runs only
}
DEVICE_CACHE_TOKENS = 4096  # device KV cache of every server: 128 blocks of 32
MAX_MODEL_LEN = 2560
PROMPT_TOKENS = 2048
CHUNK = 256
GiB = 2**30
#: the host tier of every kvtier row: at most this (more than the workloads fill) ...
HOST_TIER_MAX = 1 * GiB
#: ... and what kvtier leaves free besides it (its cpu_headroom_bytes; 4 GiB by default,
#: sized for GPU servers), lowered to HEADROOM_MIN when the machine has little free
HEADROOM = 1 * GiB
HEADROOM_MIN = 256 * 2**20
#: what the vLLM server of a row takes before kvtier checks the host memory it needs
#: (torch, the engine and its worker, the weights, the device KV cache); an in-process
#: engine of the bench model held about 1.2 GiB resident there, a server adds its API
#: process
ENGINE_BYTES = 5 * GiB // 2


@dataclass(frozen=True)
class Plan:
    """How many requests each phase sends."""

    cold: int
    repeat: int
    connector: int
    shared: int
    mt_sessions: int
    mt_turns: int
    restart_all: bool


PLANS = {
    "full": Plan(
        cold=8, repeat=8, connector=8, shared=6, mt_sessions=8, mt_turns=6, restart_all=True
    ),
    "quick": Plan(
        cold=2, repeat=4, connector=4, shared=4, mt_sessions=8, mt_turns=4, restart_all=False
    ),
}


@dataclass(frozen=True)
class Config:
    """One server configuration under test."""

    name: str
    label: str
    kind: str  # "vllm" | "example" | "lmcache" | "kvtier"
    remote: str | None = None  # kvtier object tier: "file" | "s3" | "redis"
    persistent: bool = False  # its cache outlives a vLLM restart


CONFIGS = (  # the goals' configurations first, so a cut-short run still answers them
    Config("vllm", "vLLM, no connector", "vllm"),
    Config("kvtier-host", "kvtier, host tier", "kvtier"),
    Config("kvtier-file", "kvtier, host + file tier", "kvtier", "file", persistent=True),
    Config("example", "vLLM ExampleConnector", "example", persistent=True),
    Config("lmcache", "LMCache 0.5.6 (MP mode)", "lmcache", persistent=True),
    Config("kvtier-s3", "kvtier, host + S3 tier (moto)", "kvtier", "s3", persistent=True),
    Config("kvtier-redis", "kvtier, host + Redis tier", "kvtier", "redis", persistent=True),
)


def working_set_bytes(plan: Plan, shape: dict[str, int]) -> int:
    """Host-tier bytes the workloads can fill: every chunk they send, none evicted (the
    repeated prompt, the 75 %-shared prompts, every multi-turn session's history)."""
    tokens = PROMPT_TOKENS * (1 + plan.cold)  # workload 1: the cold prompts, one repeated
    tokens += 1536 + plan.shared * 512  # workload 2: one shared prefix, distinct tails
    tokens += plan.mt_sessions * (256 + plan.mt_turns * (256 + 8))  # workload 3
    chunks = -(-tokens // CHUNK) + 3 * plan.mt_sessions  # partial chunks of each session
    return chunks * CHUNK * kv_bytes_per_token(shape)


def host_tier_plan(need: int, floor: int, available: int) -> tuple[int, int]:
    """(cpu_bytes, cpu_headroom_bytes) for a kvtier row when ``available`` bytes of host
    memory are free before its server starts: the host tier as large as HOST_TIER_MAX,
    at least ``need`` (what the workloads fill), with the vLLM server's own memory
    (ENGINE_BYTES) and HEADROOM (at least HEADROOM_MIN) left over. Short of that, down to
    ``floor`` (the repeated prompt's chunks: its hit and restart rows stay measurable, the
    multi-turn sessions evict). :class:`Unavailable` below that, before any server
    starts, with the numbers (kvtier itself would refuse it at startup)."""
    for headroom in (HEADROOM, HEADROOM_MIN):
        spare = available - ENGINE_BYTES - headroom
        if spare >= need:
            return min(HOST_TIER_MAX, spare), headroom
    if spare >= floor:
        return spare, HEADROOM_MIN
    raise Unavailable(
        f"{available / GiB:.2f} GiB of host memory available; a kvtier row needs at least "
        f"{(floor + ENGINE_BYTES + HEADROOM_MIN) / GiB:.2f} GiB (host tier "
        f"{floor / 2**20:.0f} MiB + vLLM {ENGINE_BYTES / GiB:.1f} GiB + headroom "
        f"{HEADROOM_MIN / 2**20:.0f} MiB)"
    )


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kv_bytes_per_token(shape: dict[str, int]) -> int:
    """K and V, every layer, bf16."""
    head_dim = shape["hidden"] // shape["heads"]
    return 2 * shape["kv_heads"] * head_dim * 2 * shape["layers"]


# ------------------------------------------------------------------- one config


class Setup:
    """Servers and settings a configuration needs besides vLLM itself."""

    def __init__(
        self, cfg: Config, workdir: Path, args: argparse.Namespace, plan: Plan = PLANS["full"]
    ) -> None:
        self.cfg, self.workdir, self.args, self.plan = cfg, workdir / cfg.name, args, plan
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.python = sys.executable
        self.kv_transfer: dict[str, Any] | None = None
        self.env: dict[str, str] = {}
        self.vllm_args: list[str] = []
        self._procs: list[harness.Proc] = []

    def __enter__(self) -> Setup:
        try:
            getattr(self, "_setup_" + self.cfg.kind)()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in reversed(self._procs):
            p.stop(grace=10)

    def _setup_vllm(self) -> None:
        pass

    def _setup_example(self) -> None:
        self.kv_transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(self.workdir / "kv")},
        }

    def _setup_lmcache(self) -> None:
        venv = HERE / ".venv-lmcache"
        self.python = str(
            harness.ensure_lmcache_venv(
                venv, self.workdir / "install.log", install=not self.args.no_install
            )
        )
        proc, port = harness.start_lmcache_server(venv, self.workdir, CHUNK)
        self._procs.append(proc)
        self.kv_transfer = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": port,
                "lmcache.mp.mq_timeout": 30,
            },
        }

    def _setup_kvtier(self) -> None:
        import importlib.util

        if importlib.util.find_spec("kvtier.connectors.vllm") is None:
            raise Unavailable("kvtier.connectors.vllm is not there yet")
        extra: dict[str, Any] = {"chunk_size": CHUNK}
        if self.cfg.remote == "file":
            store = self.workdir / "store"
            store.mkdir(exist_ok=True)
            extra["remote_url"] = store.as_uri()
        elif self.cfg.remote == "s3":
            proc, endpoint, aws = harness.start_moto(self.workdir)
            self._procs.append(proc)
            bucket = f"kvtier-bench-{uuid.uuid4().hex[:8]}"
            harness.create_bucket(endpoint, bucket)
            extra |= {"remote_url": f"s3://{bucket}/kv", "s3_endpoint_url": endpoint}
            self.env |= aws
        elif self.cfg.remote == "redis":
            proc, url = harness.start_redis(self.workdir)
            self._procs.append(proc)
            extra["remote_url"] = url
        if self.cfg.remote:
            _check_kvtier_config(extra, self.env)
        # sized now, with this row's store running: what the machine has free decides
        shape = SHAPES[self.args.model_shape]
        need = working_set_bytes(self.plan, shape)
        floor = 4 * PROMPT_TOKENS * kv_bytes_per_token(shape)
        cpu, headroom = host_tier_plan(need, floor, mem_available_bytes())
        extra |= {"cpu_bytes": cpu, "cpu_headroom_bytes": headroom}
        # the restart row times the load path: with the first-hit canary on, the restarted
        # engine's first hit is computed and checked instead (once per engine start)
        extra.setdefault("canary_first_hit", False)
        log(
            f"{self.cfg.name}: host tier {cpu / 2**20:.0f} MiB (the workloads fill "
            f"{need / 2**20:.0f} MiB), headroom {headroom / 2**20:.0f} MiB"
        )
        # as kvtier advises: stopping vLLM writes the chunks still queued
        # (connectors.worker.shutdown)
        env, self.vllm_args = shutdown_flags(extra)
        self.env |= env
        self.kv_transfer = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
            # a chunk that fails to load is recomputed, not the request failed: and with a
            # local directory tier, lookups then answer in their own step
            # (connectors.scheduler.one_step_lookups)
            "kv_load_failure_policy": self.args.kv_load_failure_policy,
        }


def _check_kvtier_config(extra: dict[str, Any], env: dict[str, str]) -> None:
    """Refuse early (as unavailable) an object tier this kvtier cannot build yet."""
    try:
        from kvtier.config import load_config
        from kvtier.objects.tiers import open_tier
    except ImportError as exc:
        raise Unavailable(f"kvtier's object tier does not import: {exc}") from exc
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the S3 tier's boto3 reads its credentials from the environment
    try:
        open_tier(load_config(extra)).close()
    except Exception as exc:  # noqa: BLE001 - any refusal means "not available here"
        raise Unavailable(f"kvtier cannot open {extra.get('remote_url')}: {exc}") from exc
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_phase(
    url: str,
    *,
    seed: int,
    sessions: int,
    shared: int,
    turn: int,
    turns: int = 1,
    output: int = 2,
    concurrency: int = 1,
    reset: bool = False,
    plot: str | None = None,
) -> dict[str, Any]:
    """One ``kvtier bench`` run against ``url``; its --json result."""
    argv = [
        "--url",
        url,
        "--model",
        "bench",
        "--json",
        "--seed",
        str(seed),
        "--sessions",
        str(sessions),
        "--turns",
        str(turns),
        "--shared-prefix-tokens",
        str(shared),
        "--turn-tokens",
        str(turn),
        "--output-tokens",
        str(output),
        "--concurrency",
        str(concurrency),
        "--timeout",
        "120",
    ]
    if reset:
        argv.append("--reset-prefix-cache")
    if plot:
        argv += ["--plot", plot, "--metrics-interval", "0.5"]
    args = bench.build_parser().parse_args(argv)
    res = bench.execute(args, progress=False)
    if plot:
        bench.write_plot(res, plot)
    return res


def run_config(
    cfg: Config,
    plan: Plan,
    model: Path,
    kv_bytes: int,
    workdir: Path,
    out: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Start the configuration's servers, run every phase, stop them."""
    phases: dict[str, Any] = {}
    record: dict[str, Any] = {"label": cfg.label, "phases": phases}
    try:
        with Setup(cfg, workdir, args, plan) as st:
            server = VLLMServer(
                python=st.python,
                model=model,
                kv_transfer=st.kv_transfer,
                kv_cache_bytes=kv_bytes,
                max_model_len=MAX_MODEL_LEN,
                env=st.env,
                log=st.workdir / "vllm.log",
                args=st.vllm_args,
            )
            try:
                server.start()
                record["server_start_s"] = server.start_s
                log(f"{cfg.name}: server up in {server.start_s:.0f} s")
                _phases(cfg, plan, server, phases, out)
                if cfg.persistent and (plan.restart_all or cfg.name == "kvtier-file"):
                    server.stop()
                    server.log = st.workdir / "vllm-restarted.log"
                    server.start()
                    log(f"{cfg.name}: restarted vLLM in {server.start_s:.0f} s")
                    phases["restart"] = bench_phase(
                        server.url, seed=11, sessions=plan.cold, shared=0, turn=PROMPT_TOKENS
                    )
                    _say(cfg, "restart", phases["restart"])
            finally:
                server.stop()
            if st.kv_transfer and "cpu_bytes" in st.kv_transfer["kv_connector_extra_config"]:
                record["cpu_bytes"] = st.kv_transfer["kv_connector_extra_config"]["cpu_bytes"]
    except Unavailable as exc:
        record["unavailable"] = str(exc)
        log(f"{cfg.name}: unavailable: {exc}")
    except Exception as exc:  # noqa: BLE001 - one broken peer must not stop the comparison
        record["unavailable"] = f"{type(exc).__name__}: {exc}"
        log(f"{cfg.name}: failed: {traceback.format_exc()}")
    return record


def _phases(cfg: Config, plan: Plan, server: VLLMServer, phases: dict[str, Any], out: Path) -> None:
    def phase(name: str, **kw: Any) -> None:
        if server.proc is None or not server.proc.alive:
            raise RuntimeError(f"vLLM died before {name}: {harness.failure_reason(server.log)}")
        phases[name] = bench_phase(server.url, **kw)
        _say(cfg, name, phases[name])

    # workload 1: a 2,048-token prompt
    phase("cold", seed=11, sessions=plan.cold, shared=0, turn=PROMPT_TOKENS)
    phase("repeat", seed=12, sessions=plan.repeat, shared=PROMPT_TOKENS, turn=0)
    phase("connector", seed=12, sessions=plan.connector, shared=PROMPT_TOKENS, turn=0, reset=True)
    # workload 2: 75 % shared
    phase("shared75", seed=13, sessions=plan.shared, shared=1536, turn=512, reset=True)
    if cfg.kind == "vllm":
        phase("shared75_engine", seed=15, sessions=plan.shared, shared=1536, turn=512)
    # workload 3: interleaved multi-turn sessions, histories >> device cache
    phase(
        "multiturn",
        seed=14,
        sessions=plan.mt_sessions,
        turns=plan.mt_turns,
        shared=256,
        turn=256,
        output=8,
        concurrency=2,
        plot=str(out / f"multiturn-{cfg.name}.png"),
    )


def _say(cfg: Config, phase: str, res: dict[str, Any]) -> None:
    hr = res["hit_rate"]
    log(
        f"{cfg.name}/{phase}: {res['requests']} req, {res['failed']} failed, "
        f"TTFT p50 {_ms(res['ttft_p50_s'])}, {res['throughput_rps']:.2f} req/s, "
        f"hit {'-' if hr is None else f'{hr:.0%}'} [{res['hit_rate_source'].split(' ')[0]}]"
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


# -------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, fewer restarts")
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated configurations: " + ",".join(c.name for c in CONFIGS),
    )
    ap.add_argument("--out", type=Path, default=HERE / "results", help="results directory")
    ap.add_argument(
        "--kv-load-failure-policy",
        choices=("recompute", "fail"),
        default="recompute",
        help="vLLM's kv_load_failure_policy for the kvtier rows (recompute, as "
        "kvtier advises: a local directory tier's lookups then answer in "
        "their own step; fail: they take a step of their own)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="models, logs and stores (default: a directory under the system temp)",
    )
    ap.add_argument(
        "--model-shape",
        choices=sorted(SHAPES),
        default="bench",
        help="'tiny' only for smoke-testing the runner",
    )
    ap.add_argument(
        "--no-install",
        action="store_true",
        help="do not create bench/.venv-lmcache; report LMCache unavailable instead",
    )
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    plan = PLANS["quick" if args.quick else "full"]
    names = args.only.split(",") if args.only else [c.name for c in CONFIGS]
    unknown = set(names) - {c.name for c in CONFIGS}
    if unknown:
        ap.error(f"unknown configuration(s): {', '.join(sorted(unknown))}")
    workdir = args.workdir or Path(tempfile.gettempdir()) / f"kvtier-bench-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.model_shape]
    log(f"building the {shape['layers']}-layer, {shape['hidden']}-wide model in {workdir}")
    from kvtier.cli.tinymodel import build_tiny_llama

    models = (args.workdir or Path(tempfile.gettempdir()) / "kvtier-bench") / "models"
    model = build_tiny_llama(models / args.model_shape, **shape)  # idempotent: reused
    kv_bytes = DEVICE_CACHE_TOKENS * kv_bytes_per_token(shape)

    results: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "make bench" + (" (--quick)" if args.quick else ""),
            "argv": sys.argv[1:] if argv is None else argv,
            "plan": plan.__dict__,
            "model_shape": shape,
            "device_cache_tokens": DEVICE_CACHE_TOKENS,
            "kv_cache_memory_bytes": kv_bytes,
            "max_model_len": MAX_MODEL_LEN,
            "chunk_size": CHUNK,
            "omp_threads_bind": harness.omp_cpus(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
            f"{platform.processor() or platform.platform()}",
            "vllm": _version("vllm"),
            "python": platform.python_version(),
        },
        "configs": {},
    }
    for cfg in CONFIGS:
        if cfg.name not in names:
            continue
        log(f"=== {cfg.name}: {cfg.label}")
        load_before = os.getloadavg()[0]
        results["configs"][cfg.name] = run_config(
            cfg, plan, model, kv_bytes, workdir, args.out, args
        )
        # other processes on the machine skew every timing; say how busy it was
        results["configs"][cfg.name]["load_avg_1m"] = [load_before, os.getloadavg()[0]]
        for store in ("kv", "store"):  # KV dumps are big; the logs stay for a post-mortem
            shutil.rmtree(workdir / cfg.name / store, ignore_errors=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    results["meta"]["duration_s"] = time.monotonic() - t0
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    summary = report.summarize(results)
    md = report.markdown(results, summary)
    (args.out / "results.md").write_text(md)
    report.plots(results, summary, args.out)
    print(report.console(summary))
    log(
        f"done in {results['meta']['duration_s'] / 60:.1f} min; wrote {args.out / 'results.md'}; "
        f"server logs in {workdir}"
    )
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in (dist, dist + "-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


if __name__ == "__main__":
    raise SystemExit(main())
