"""``kvtier bench`` against a fake OpenAI-compatible server, and against real vLLM (e2e).

The fake server is a real HTTP server on loopback (threaded ``http.server``):
it streams SSE chunks after a controlled delay, answers 500 to every Nth
completion, and serves a ``/metrics`` page whose counters move by known
amounts per request — so TTFT, failure counting and the metric-delta hit rate
are checked against numbers the test chose, over a real socket.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_openai import (
    FIRST_TOKEN_DELAY,
    HIT_PER_REQUEST,
    LOOKUP_PER_REQUEST,
    TOKEN_DELAY,
    FakeServer,
    bench_args,
    serving,
)
from kit import free_port

from kvtier.cli import bench, promtext
from kvtier.sizing.emit import connector_config


@pytest.fixture
def fake() -> Iterator[tuple[FakeServer, str]]:
    """A started fake server; the test may change its knobs before the run."""
    state = FakeServer()
    with serving(state) as url:
        yield state, url


def test_ttft_table_and_hit_rate_from_deltas(fake: tuple[FakeServer, str], capsys: Any) -> None:
    state, url = fake
    assert bench.run(bench_args(url)) == 0
    out = capsys.readouterr().out
    assert state.completions == 8
    for label in ("requests", "throughput", "TTFT p50 / p99", "TTFT hit", "TTFT miss", "hit rate"):
        assert label in out, out
    assert "8 (0 failed)" in out
    # 30 of 40 looked-up tokens per request, whatever the totals were before the run
    assert "75.0 %" in out and "kvtier:hit_tokens_total" in out


def test_json_fields_ttft_and_outcomes(fake: tuple[FakeServer, str], capsys: Any) -> None:
    state, url = fake
    assert bench.run(bench_args(url, "--json")) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("requests", "failed", "throughput_rps", "ttft_p50_s", "ttft_p99_s", "hit_rate"):
        assert key in res
    assert res["requests"] == 8 and res["failed"] == 0
    assert res["model"] == "fake-model"
    # client TTFT is the server's first-chunk delay, not the whole stream (5 x 10 ms more)
    assert FIRST_TOKEN_DELAY <= res["ttft_p50_s"] < FIRST_TOKEN_DELAY + 0.5
    assert all(s["latency_s"] >= s["ttft_s"] + 4 * TOKEN_DELAY for s in res["samples"])
    assert res["hit_rate"] == pytest.approx(HIT_PER_REQUEST / LOOKUP_PER_REQUEST)
    assert res["hit_rates"]["vllm_prefix_cache"] == pytest.approx(0.1)
    assert res["metrics_deltas"]["kvtier:hit_tokens_total"] == 8 * HIT_PER_REQUEST
    # 4 hits at 0.05 s (bucket 0.04..0.06) and 4 misses at 0.3 s (0.25..0.5), interpolated
    by = res["ttft_by_outcome"]
    assert by["hit"]["count"] == 4 and by["miss"]["count"] == 4
    assert by["hit"]["p50_s"] == pytest.approx(0.05)
    assert by["miss"]["p50_s"] == pytest.approx(0.375)
    assert res["prompt_tokens_mean"] > 50 and res["cached_tokens_total"] == 3 * 8
    assert res["throughput_rps"] > 0


def test_headline_is_the_share_of_prompt_tokens_from_any_cache(
    fake: tuple[FakeServer, str], capsys: Any, tmp_path: Path
) -> None:
    """Where vLLM says where every prompt token came from, the headline is the share
    served from any cache (not only kvtier's, which counts tokens beyond vLLM's own
    cache), with the split by source in the JSON, the text and the plot."""
    state, url = fake
    state.by_source = True
    plot = tmp_path / "bench.png"
    assert bench.run(bench_args(url, "--json", "--plot", str(plot))) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["hit_rate"] == pytest.approx(0.4)
    assert res["hit_rate_source"] == promtext.ANY_CACHE
    assert res["hit_rate_by_source"] == pytest.approx(
        {
            "gpu_prefix_cache": 0.1,
            "kvtier_host": 0.3,
            "kvtier_object_tier": 0.0,
            "other_connector": 0.0,
            "computed": 0.6,
        }
    )
    assert res["prompt_tokens_by_source"]["kvtier_host"] == 8 * HIT_PER_REQUEST
    assert res["hit_rates"]["kvtier"] == pytest.approx(0.75)  # still there, beside it
    assert plot.stat().st_size > 10_000
    assert [p for p in res["hit_rate_timeline"] if p["hit_rate"] is not None]
    assert bench.run(bench_args(url)) == 0
    out = capsys.readouterr().out
    assert "40.0 %" in out and "gpu prefix cache 10.0 %" in out and "kvtier host 30.0 %" in out
    assert "computed" in out and "60.0 %" in out


def test_failed_requests_are_counted(fake: tuple[FakeServer, str], capsys: Any) -> None:
    state, url = fake
    state.fail_every = 3
    rc = bench.run(bench_args(url, "--json", "--sessions", "6", "--turns", "1"))
    res = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert res["requests"] == 6 and res["failed"] == 2
    assert list(res["errors"]) == ['HTTP 500: {"error": "injected failure"}']
    assert res["hit_rate"] == pytest.approx(0.75)  # 4 successes moved the counters


def test_every_request_failing_exits_1(fake: tuple[FakeServer, str], capsys: Any) -> None:
    state, url = fake
    state.fail_every = 1
    assert bench.run(bench_args(url)) == 1
    assert "8 x HTTP 500" in capsys.readouterr().out


def test_unreachable_server_is_a_failure_not_a_crash(capsys: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = bench_args(f"http://127.0.0.1:{port}", "--model", "m", "--json", "--turns", "1")
    assert bench.run(args) == 1
    res = json.loads(capsys.readouterr().out)
    assert res["failed"] == res["requests"] == 4
    assert res["hit_rate"] is None and res["hit_rate_source"].startswith("none")


def test_vllm_counters_when_kvtier_is_absent(fake: tuple[FakeServer, str], capsys: Any) -> None:
    state, url = fake
    state.kvtier_metrics = False
    assert bench.run(bench_args(url, "--json")) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["hit_rate"] == pytest.approx(0.1)
    assert res["hit_rate_source"].startswith("vllm:prefix_cache_hits_total")
    assert res["ttft_by_outcome"] == {}


def test_multi_turn_prompts_extend_previous_prompt_and_answer(
    fake: tuple[FakeServer, str], capsys: Any
) -> None:
    state, url = fake
    assert bench.run(bench_args(url, "--json", "--turns", "3", "--concurrency", "1")) == 0
    # sessions interleave turn by turn: s0t0 s1t0 s2t0 s3t0 s0t1 ... (completion n = index + 1)
    first, second, third = state.prompts[0], state.prompts[4], state.prompts[8]
    assert second.startswith(first + "\n tok1_0 tok1_1")
    assert third.startswith(second + "\n tok5_0")
    assert state.prompts[1].split()[:49] == first.split()[:49]  # the 50-token shared prefix
    res = json.loads(capsys.readouterr().out)
    order = [(s["session"], s["turn"]) for s in res["samples"]]
    assert order[:6] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1)]


def test_reset_prefix_cache_before_each_request(fake: tuple[FakeServer, str], capsys: Any) -> None:
    state, url = fake
    assert bench.run(bench_args(url, "--json", "--reset-prefix-cache")) == 0
    assert state.resets == 8


def test_plot_writes_png(fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any) -> None:
    _, url = fake
    png = tmp_path / "bench.png"
    args = bench_args(url, "--plot", str(png), "--metrics-interval", "0.1")
    assert bench.run(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in capsys.readouterr().out


def test_hit_rate_timeline_is_scraped_during_the_run(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    _, url = fake
    args = bench_args(url, "--json", "--plot", str(tmp_path / "p.png"), "--metrics-interval", "0.1")
    assert bench.run(args) == 0
    res = json.loads(capsys.readouterr().out)
    tl = res["hit_rate_timeline"]
    assert len(tl) >= 3 and [p["t_s"] for p in tl] == sorted(p["t_s"] for p in tl)
    moved = [p["hit_rate"] for p in tl if p["hit_rate"] is not None]
    assert moved and all(r == pytest.approx(0.75) for r in moved)  # kvtier's counters, always


def test_request_rate_paces_arrivals(fake: tuple[FakeServer, str], capsys: Any) -> None:
    _, url = fake
    rate, n = 10.0, 6
    rng = random.Random("kvtier-bench:0:arrivals")
    gaps = [rng.expovariate(rate) for _ in range(n)]
    args = bench_args(
        url,
        "--json",
        "--sessions",
        str(n),
        "--turns",
        "1",
        "--concurrency",
        str(n),
        "--request-rate",
        str(rate),
    )
    assert bench.run(args) == 0
    starts = sorted(s["start_s"] for s in json.loads(capsys.readouterr().out)["samples"])
    assert starts[-1] >= sum(gaps) - 0.05


def test_workload_is_deterministic_and_shares_the_prefix() -> None:
    kw = dict(sessions=3, turns=3, shared_prefix_tokens=300, turn_tokens=100)
    a, b = bench.make_workload(seed=7, **kw), bench.make_workload(seed=7, **kw)
    assert a == b
    assert a != bench.make_workload(seed=8, **kw)
    shared = a[0].first_prompt.split()[:300]
    assert shared[0] == bench.LEAD_WORD
    for s in a:
        words = s.first_prompt.split()
        assert words[:300] == shared and len(words) == 400
        assert words[300:] != a[(s.index + 1) % 3].first_prompt.split()[300:]
        assert [len(t.split()) for t in s.follow_ups] == [100, 100]
    # two tokens per word, three for the start: (300 - 3) / 2 words after the lead word
    half = bench.make_workload(seed=7, scale=bench.TokenScale(per_word=2.0, lead=3.0), **kw)
    assert len(half[0].first_prompt.split()) == 1 + round(297 / 2) + 50
    # no shared prefix: every prompt still opens with the lead word, the rest differs
    cold = bench.make_workload(seed=7, sessions=2, turns=1, shared_prefix_tokens=0, turn_tokens=64)
    assert [c.first_prompt.split()[0] for c in cold] == [bench.LEAD_WORD] * 2
    assert cold[0].first_prompt != cold[1].first_prompt
    assert len(cold[0].first_prompt.split()) == 64


def test_prompt_lengths_hit_the_token_counts(fake: tuple[FakeServer, str], capsys: Any) -> None:
    """Calibrated through /tokenize (which counts a BOS here), first turns are exact."""
    _, url = fake
    assert bench.run(bench_args(url, "--json", "--turns", "1")) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["workload"]["lead_tokens"] == 2.0 and res["workload"]["tokens_per_word"] == 1.0
    assert {s["prompt_tokens"] for s in res["samples"]} == {50 + 10}


def test_metrics_parsing_and_quantiles() -> None:
    text = (
        '# TYPE x counter\nx_total{a="q\\"uote",b="2"} 3.5\nx_total{a="z"} 1e1\n'
        'h_bucket{le="0.1"} 2\nh_bucket{le="1.0"} 4\nh_bucket{le="+Inf"} 5\ngarbage line\n'
    )
    snap = promtext.Snapshot(0.0, promtext.parse_metrics(text))
    assert snap.total("x_total") == 13.5 and snap.total("y_total") is None
    assert snap.samples[0][1] == {"a": 'q"uote', "b": "2"}
    b = sorted(snap.buckets("h", "outcome")[""].items())
    assert promtext.histogram_quantile(0.2, b) == pytest.approx(0.05)
    assert promtext.histogram_quantile(0.6, b) == pytest.approx(0.55)
    assert promtext.histogram_quantile(0.99, b) == pytest.approx(1.0)  # +Inf bucket: last finite le
    assert promtext.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert promtext.quantile([], 0.5) is None


def test_wired_as_kvtier_bench(fake: tuple[FakeServer, str], capsys: Any) -> None:
    from kvtier.cli import main as cli

    _, url = fake
    rc = cli.main(
        [
            "bench",
            "--url",
            url + "/v1",
            "--json",
            "--sessions",
            "2",
            "--shared-prefix-tokens",
            "20",
            "--turn-tokens",
            "5",
            "--output-tokens",
            "2",
        ]
    )
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 2


def test_bad_flags_exit_2(capsys: Any) -> None:
    args = bench.build_parser().parse_args(["--sessions", "0"])
    assert bench.run(args) == 2
    assert "--sessions" in capsys.readouterr().err


def test_module_imports_neither_torch_vllm_nor_matplotlib(fake: tuple[FakeServer, str]) -> None:
    _, url = fake
    code = (
        "import sys\nfrom kvtier.cli import bench\n"
        f"rc = bench.run(bench.build_parser().parse_args(['--url', '{url}', '--json', "
        "'--sessions', '2', '--shared-prefix-tokens', '20', '--turn-tokens', '5', "
        "'--output-tokens', '2']))\n"
        "bad = [m for m in ('torch', 'vllm', 'matplotlib') if m in sys.modules]\n"
        "assert rc == 0 and not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["requests"] == 2


# ---------------------------------------------------------------------------- e2e

KVTIER_CONFIG = connector_config({"cpu_bytes": "256MiB", "chunk_size": 256})


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_e2e_real_vllm_with_kvtier(tmp_path: Path, capsys: Any) -> None:
    """A handful of requests through vLLM's CPU server with kvtier: none fail, kvtier hits.

    vLLM's own prefix cache is reset before every request, so the hits counted
    can only have come from kvtier's host tier.
    """
    import httpx

    from kvtier.cli.tinymodel import build_tiny_llama

    model = build_tiny_llama(tmp_path / "model", layers=4, hidden=256)
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    log = open(tmp_path / "vllm.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--block-size",
            "32",
            "--max-model-len",
            "2048",
            "--kv-transfer-config",
            json.dumps(KVTIER_CONFIG),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                if (
                    httpx.get(
                        f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False
                    ).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vLLM did not start in 300 s"
            time.sleep(1)
        args = bench.build_parser().parse_args(
            [
                "--url",
                f"http://127.0.0.1:{port}",
                "--json",
                "--sessions",
                "3",
                "--turns",
                "2",
                "--shared-prefix-tokens",
                "600",
                "--turn-tokens",
                "64",
                "--output-tokens",
                "4",
                "--concurrency",
                "1",
                "--reset-prefix-cache",
            ]
        )
        rc = bench.run(args)
        res = json.loads(capsys.readouterr().out)
        assert rc == 0 and res["failed"] == 0, res["errors"]
        assert res["hit_rate"] is not None and res["hit_rate"] > 0, res["hit_rates"]
        # vLLM 0.32 says where each prompt token came from: the headline is that share,
        # and kvtier's host tier served part of it (vLLM's cache is reset between turns)
        assert res["hit_rate_source"] == promtext.ANY_CACHE, res["hit_rate_source"]
        shares = res["hit_rate_by_source"]
        assert shares["kvtier_host"] > 0 and shares["computed"] < 1, shares
        assert res["hit_rate"] == pytest.approx(1 - shares["computed"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


# ------------------------------------------------------------- bench/report.py


def _load_report() -> Any:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "report.py"
    spec = importlib.util.spec_from_file_location("bench_report", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _phase(ttfts: list[float], rps: float = 1.0) -> dict[str, Any]:
    samples = [{"start_s": float(i), "ok": True, "ttft_s": t} for i, t in enumerate(ttfts)]
    return {
        "samples": samples,
        "requests": len(ttfts),
        "failed": 0,
        "throughput_rps": rps,
        "ttft_p50_s": promtext.quantile(ttfts, 0.5),
        "hit_rate": 0.5,
        "hit_rates": {"kvtier": 0.5, "vllm_prefix_cache": 0.0, "vllm_external": 0.5},
    }


def test_report_ratios_goals_and_unavailable_peers(tmp_path: Path) -> None:
    report = _load_report()
    results = {
        "meta": {
            "started": "now",
            "command": "make bench",
            "machine": "test",
            "vllm": "0.32.0",
            "python": "3.11",
            "model_shape": {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8},
            "kv_cache_memory_bytes": 1,
            "device_cache_tokens": 4096,
            "max_model_len": 2560,
            "chunk_size": 256,
            "plan": {"mt_sessions": 8, "mt_turns": 6},
        },
        "configs": {
            "vllm": {
                "label": "vLLM",
                "phases": {
                    "cold": _phase([1.0, 1.2, 1.1]),
                    "repeat": _phase([1.0, 0.05, 0.05, 0.05]),
                    "connector": _phase([1.0, 1.0]),
                    "shared75": _phase([1.0, 1.0, 1.0]),
                    "shared75_engine": _phase([1.0, 0.3, 0.3]),
                    "multiturn": _phase([0.5], 1.0),
                },
            },
            "kvtier-host": {
                "label": "kvtier",
                "phases": {
                    "cold": _phase([1.1]),
                    "repeat": _phase([1.1, 0.05]),
                    "connector": _phase([0.05, 0.06, 0.05]),
                    "shared75": _phase([1.0, 0.3, 0.3]),
                    "multiturn": _phase([0.2], 2.5),
                },
            },
            "kvtier-file": {"label": "kvtier file", "phases": {"restart": _phase([0.1])}},
            "lmcache": {"label": "LMCache", "unavailable": "no lmcache here", "phases": {}},
            "example": {
                "label": "Example",
                "phases": {
                    "connector": _phase([0.1]),
                    "shared75": _phase([1.0, 1.0]),
                    "multiturn": _phase([0.5], 1.0),
                },
            },
        },
    }
    summary = report.summarize(results)
    k = summary["rows"]["kvtier-host"]["ratios"]
    assert k["hit_vs_engine"] == pytest.approx(1.0)
    assert k["shared_vs_cold"] == pytest.approx(0.3)
    assert k["mt_rps_vs_none"] == pytest.approx(2.5)
    assert summary["rows"]["kvtier-file"]["ratios"]["restart_vs_engine"] == pytest.approx(2.0)
    goals = {g["goal"]: g["met"] for g in summary["goals"]}
    assert goals["host-tier hit ÷ in-engine hit (2,048-token prompt)"] is True
    assert goals["file-tier hit after restart ÷ in-engine hit"] is False
    assert goals["Example ÷ kvtier, connector-hit TTFT"] is True
    assert summary["peers"]["example"]["mt_rps"] == pytest.approx(0.4)
    assert summary["peers"]["lmcache"]["hit"] is None
    md = report.markdown(results, summary)
    assert "LMCache: unavailable: no lmcache here" in md
    assert "| 2.50× |" in md
    report.plots(results, summary, tmp_path)
    assert (tmp_path / "ttft.png").exists() and (tmp_path / "multiturn.png").exists()
    assert "goals:" in report.console(summary)
