"""Host-tier hit TTFT against vLLM's own prefix hit and a cold prefill, in one run.

On a locally built 8-layer, 1024-wide Llama and a 2,048-token prompt, measures
the median time to first token of

  (a) a cold prefill (nothing cached anywhere),
  (b) vLLM's own in-engine prefix-cache hit,
  (c) a kvtier host-tier hit right after ``LLM.reset_prefix_cache()``,

and prints c/b and c/a. Each sample uses a fresh prompt so (a) is really cold.

With ``--restart file,s3,redis`` it then measures, for each object tier,
(d) a hit after an engine restart: one engine stores the prompts and exits, a
new engine (empty host tier) serves them from the object tier, and d/b is
printed beside c/b. S3 is moto's server and Redis Debian's redis-server, both
started on loopback by this script.

Run it with ``make bench-ttft`` (about 3 minutes on 2 cores, plus ~1 minute a tier).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _prompt(seed: int, n: int) -> list[int]:
    return [((i * 7919 + seed * 104729 + seed * seed) % 480) + 5 for i in range(n)]


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens or 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


@contextlib.contextmanager
def _tier(kind: str, workdir: str) -> Iterator[tuple[dict, dict]]:
    """(extra config, env) of one object tier, its server started for the duration."""
    if kind == "file":
        path = os.path.join(workdir, "tier")
        shutil.rmtree(path, ignore_errors=True)
        yield {"remote_url": f"file://{path}"}, {}
        return
    port = _free_port()
    if kind == "redis":
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no"]
    else:
        argv = [sys.executable, "-m", "moto.server", "-p", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port)
        if kind == "redis":
            yield {"remote_url": f"redis://127.0.0.1:{port}/0"}, {}
        else:
            env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                   "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
            import boto3

            endpoint = f"http://127.0.0.1:{port}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                         aws_access_key_id="bench", aws_secret_access_key="bench"
                         ).create_bucket(Bucket="kvtier-bench")
            yield {"remote_url": "s3://kvtier-bench/kv", "s3_endpoint_url": endpoint}, env
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _phase(args: argparse.Namespace, phase: str, extra: dict, env: dict) -> dict:
    """Run one engine of the restart measurement in its own process."""
    cmd = [sys.executable, __file__, "--phase", phase, "--extra", json.dumps(extra),
           "--tokens", str(args.tokens), "--samples", str(args.samples),
           "--layers", str(args.layers), "--hidden", str(args.hidden)]
    if args.model_dir:
        cmd += ["--model-dir", args.model_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{phase} engine failed:\n{proc.stderr[-4000:]}")


def _restart_engine(args: argparse.Namespace, llm_factory) -> dict:
    """--phase write: store the prompts and exit. --phase read: (d) then (b) per prompt."""
    extra = json.loads(args.extra)
    llm = llm_factory(extra)
    _ttft(llm, _prompt(999, args.tokens))
    if args.phase == "write":
        for i in range(args.samples):
            _ttft(llm, _prompt(500 + i, args.tokens))
        llm.llm_engine.engine_core.shutdown()  # flushes queued uploads
        return {}
    restart_hit, engine_hit, cached = [], [], []
    for i in range(args.samples):
        p = _prompt(500 + i, args.tokens)
        t, c = _ttft(llm, p)  # host tier empty: served by the object tier
        restart_hit.append(t)
        cached.append(c)
        engine_hit.append(_ttft(llm, p)[0])
    llm.llm_engine.engine_core.shutdown()  # stops the engine's processes
    return {"restart_hit_ttft_s": statistics.median(restart_hit),
            "engine_hit_ttft_s": statistics.median(engine_hit), "cached": cached}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument("--samples", type=int, default=7, help="prompts per case")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--model-dir", help="where to build the model (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--restart", default="",
        help="comma-separated object tiers to measure a hit after an engine restart on "
        "(file, s3, redis)",
    )
    parser.add_argument("--phase", choices=["write", "read"], help=argparse.SUPPRESS)
    parser.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from kvtier.sizing.tinymodel import build_tiny_llama
    from vllm import LLM

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "kvtier-bench-model")
    model = build_tiny_llama(
        model_dir, layers=args.layers, hidden=args.hidden, heads=16, kv_heads=8
    )

    def make_llm(extra: dict) -> LLM:
        ktc = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes": "1GiB", "cpu_headroom_bytes": "1GiB", "chunk_size": 256, **extra,
            },
        }
        return LLM(model=str(model), enforce_eager=True, block_size=32, max_model_len=4096,
                   seed=0, kv_transfer_config=ktc)

    if args.phase:
        print("RESULT " + json.dumps(_restart_engine(args, make_llm)), flush=True)
        os._exit(0)
    if args.restart:
        args.model_dir = str(model)
        restarts = {}
        for kind in filter(None, args.restart.split(",")):
            with _tier(kind, tempfile.mkdtemp(prefix="kvtier-bench-")) as (extra, env):
                _phase(args, "write", extra, env)
                restarts[kind] = _phase(args, "read", extra, env)
    else:
        restarts = {}
    llm = make_llm({})
    _ttft(llm, _prompt(999, args.tokens))  # warm-up: first-run kernel setup
    cold, engine_hit, kvtier_hit = [], [], []
    cached = {"engine": [], "kvtier": []}
    for i in range(args.samples):
        p = _prompt(i, args.tokens)
        llm.reset_prefix_cache()
        cold.append(_ttft(llm, p)[0])
        t, c = _ttft(llm, p)
        engine_hit.append(t)
        cached["engine"].append(c)
        llm.reset_prefix_cache()
        t, c = _ttft(llm, p)
        kvtier_hit.append(t)
        cached["kvtier"].append(c)
    a, b, c = (statistics.median(x) for x in (cold, engine_hit, kvtier_hit))
    result = {
        "prompt_tokens": args.tokens,
        "samples": args.samples,
        "model": f"{args.layers} layers x {args.hidden}",
        "cold_ttft_s": a,
        "engine_hit_ttft_s": b,
        "kvtier_hit_ttft_s": c,
        "kvtier_over_engine_hit": c / b,
        "kvtier_over_cold": c / a,
        "cached_tokens_engine": cached["engine"][0],
        "cached_tokens_kvtier": cached["kvtier"][0],
        "restart": {
            k: {**v, "over_engine_hit": v["restart_hit_ttft_s"] / v["engine_hit_ttft_s"]}
            for k, v in restarts.items()
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\nTTFT, median of {args.samples}, {args.tokens}-token prompt, {result['model']}")
        print(f"  (a) cold prefill                  {a * 1000:8.1f} ms")
        print(f"  (b) vLLM in-engine prefix hit     {b * 1000:8.1f} ms"
              f"   ({result['cached_tokens_engine']} tokens cached)")
        print(f"  (c) kvtier host-tier hit          {c * 1000:8.1f} ms"
              f"   ({result['cached_tokens_kvtier']} tokens loaded)")
        print(f"  c/b = {c / b:.3f}   (goal <= 1.10)")
        print(f"  c/a = {c / a:.3f}   (goal <= 0.06)")
        for kind, r in result["restart"].items():
            d, b2 = r["restart_hit_ttft_s"] * 1000, r["engine_hit_ttft_s"] * 1000
            goal = "   (goal <= 1.5)" if kind == "file" else ""
            print(f"  (d) {kind:5} tier hit after an engine restart {d:8.1f} ms;"
                  f" ÷ in-engine hit there ({b2:.1f} ms) = {r['over_engine_hit']:.2f}{goal}")
    sys.stdout.flush()
    llm.llm_engine.engine_core.shutdown()  # stop the engine core and worker processes
    os._exit(0)  # then skip the interpreter's slow teardown


if __name__ == "__main__":
    raise SystemExit(main())
