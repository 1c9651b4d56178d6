"""``kvtier bench --trace``: a trace replayed against the fake OpenAI-compatible server.

Hash-id lines become the tokens :func:`kvtier.sizing.trace.block_tokens` gives each id;
requests start at the trace's times (divided by ``--speedup``), open loop, with at most
``--max-concurrency`` in flight; failures are counted; the planner's prediction for the
server's host tier is shown beside what the server's counters say it delivered.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_openai import FakeServer, serving

from kvtier.cli import bench
from kvtier.sizing import trace as tr

RANGE = (5, 480)


@pytest.fixture
def fake() -> Iterator[tuple[FakeServer, str]]:
    state = FakeServer(by_source=True)
    with serving(state) as url:
        yield state, url


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _run(url: str, trace: Path, capsys: Any, *extra: str) -> tuple[int, dict[str, Any]]:
    args = bench.build_parser().parse_args(
        [
            "--url",
            url,
            "--trace",
            str(trace),
            "--token-range",
            "5:480",
            "--json",
            "--output-tokens",
            "2",
            *extra,
        ]
    )
    rc = bench.run(args)
    out = capsys.readouterr().out
    return rc, (json.loads(out) if out.strip() else {})


def mooncake(ts_ms: float, ids: list[int], n: int, out: int = 2) -> dict[str, Any]:
    return {"timestamp": ts_ms, "input_length": n, "output_length": out, "hash_ids": ids}


def _expanded(ids: list[int], n: int, bs: int) -> list[int]:
    return tr.expand_tokens(tr.TraceRequest([], None, None, ids, n, bs), *RANGE)


def test_hash_ids_become_the_same_tokens_and_shared_ids_shared_prefixes(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    state, url = fake
    lines = [
        mooncake(0, [1, 2, 3], 40),
        mooncake(1, [1, 2, 7, 8], 60),
        mooncake(2, [9], 5),
        mooncake(3, [1, 2, 3], 44),
    ]
    path = _write(tmp_path / "t.jsonl", lines)
    rc, rep = _run(url, path, capsys, "--trace-block-size", "16", "--max-concurrency", "1")
    assert rc == 0 and rep["requests"] == 4 and rep["failed"] == 0
    sent = [b["prompt"] for _, b in sorted(state.bodies, key=lambda x: x[0])]
    assert sent == [_expanded(x["hash_ids"], x["input_length"], 16) for x in lines]
    assert all(5 <= t < 480 for p in sent for t in p)
    assert sent[1][:32] == sent[0][:32] and sent[1][32] != sent[0][32]
    assert sent[3][:40] == sent[0]  # the same ids, a longer last block: a longer prefix
    assert [b["max_tokens"] for _, b in sorted(state.bodies, key=lambda x: x[0])] == [2] * 4
    w = rep["workload"]
    assert w["trace"] == "t.jsonl" and w["format"] == "mooncake" and w["block_size"] == 16
    assert rep["trace_replay"]["prompt_tokens_sent"] == 40 + 60 + 5 + 44


@pytest.mark.timing
def test_open_loop_at_the_trace_rate_with_speedup(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    state, url = fake
    # Mooncake timestamps are ms: 0.8 s apart, at 4x: 0.2 s apart, each request taking
    # longer than that (the fake's first token comes after 0.2 s): they overlap
    lines = [mooncake(800 * i, [i], 10, out=5) for i in range(5)]
    path = _write(tmp_path / "t.jsonl", lines)
    rc, rep = _run(url, path, capsys, "--trace-block-size", "16", "--speedup", "4")
    assert rc == 0 and rep["requests"] == 5
    times = sorted(t for t, _ in state.bodies)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(0.12 < g < 0.35 for g in gaps), gaps
    assert state.max_in_flight >= 2  # open loop: the next did not wait for the last
    assert rep["trace_replay"]["late_requests"] == 0
    dues = sorted(s["due_s"] for s in rep["samples"])
    assert dues == pytest.approx([0, 0.2, 0.4, 0.6, 0.8])


def test_max_concurrency_bounds_requests_in_flight(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    state, url = fake
    path = _write(tmp_path / "t.jsonl", [mooncake(0, [i], 10) for i in range(6)])
    rc, rep = _run(url, path, capsys, "--trace-block-size", "16", "--max-concurrency", "2")
    assert rc == 0 and rep["requests"] == 6
    # the client's own intervals (the server may see the next request before its handler
    # of the last one has counted it out)
    spans = [(x["start_s"], x["start_s"] + x["latency_s"]) for x in rep["samples"]]
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) == 2
    assert state.max_in_flight >= 2
    # all were due at once: the last four waited for a free place
    assert rep["trace_replay"]["late_requests"] >= 4
    assert rep["trace_replay"]["lag_p99_s"] > 0.2


def test_max_requests_and_input_tokens_keep_shared_prefixes_shared(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    state, url = fake
    lines = [mooncake(i, [1, 2, 3, 10 + i], 60) for i in range(8)]
    path = _write(tmp_path / "t.jsonl", lines)
    rc, rep = _run(
        url,
        path,
        capsys,
        "--trace-block-size",
        "16",
        "--max-requests",
        "5",
        "--max-input-tokens",
        "40",
        "--max-concurrency",
        "1",
    )
    assert rc == 0 and rep["requests"] == 5 and len(state.bodies) == 5
    sent = [b["prompt"] for _, b in state.bodies]
    assert all(p == _expanded([1, 2, 3], 40, 16) for p in sent)  # the cut keeps the prefix
    rc, rep = _run(
        url,
        path,
        capsys,
        "--trace-block-size",
        "16",
        "--max-requests",
        "2",
        "--max-input-tokens",
        "52",
    )
    cut = [b["prompt"] for _, b in state.bodies[5:]]
    assert [len(p) for p in cut] == [52, 52] and cut[0][:48] == cut[1][:48] != []
    assert cut[0][48:] != cut[1][48:]


def test_failed_requests_are_counted_and_shown(tmp_path: Path, capsys: Any) -> None:
    state = FakeServer(fail_every=3)
    path = _write(
        tmp_path / "t.jsonl",
        [mooncake(0, [i], 10) for i in range(6)] + ["not json", {"hash_ids": []}],
    )
    with serving(state) as url:
        rc, rep = _run(url, path, capsys, "--trace-block-size", "16")
        assert rc == 0 and rep["requests"] == 6 and rep["failed"] == 2
        assert rep["errors"] == {'HTTP 500: {"error": "injected failure"}': 2}
        assert rep["trace_replay"]["bad_lines"] == 2
        args = bench.build_parser().parse_args(
            ["--url", url, "--trace", str(path), "--trace-block-size", "16"]
        )
        assert bench.run(args) == 0
    table = capsys.readouterr().out
    assert "(2 failed)" in table and "injected failure" in table
    assert "bad lines" in table and "2 skipped; line 7: not JSON" in table


def test_token_text_and_chat_lines_are_sent_as_they_are(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    state, url = fake
    msgs = [{"role": "user", "content": "hello there"}]
    lines = [
        {"prompt_token_ids": [7, 8, 9], "timestamp": 0, "cache_salt": "tenant"},
        {"prompt": "the quick fox", "timestamp": 0.01},
        {"messages": msgs, "timestamp": 0.02, "output_length": 3},
    ]
    path = _write(tmp_path / "t.jsonl", lines)
    rc, rep = _run(url, path, capsys, "--max-concurrency", "1")
    assert rc == 0 and rep["failed"] == 0 and rep["workload"]["format"] == "mixed"
    bodies = [b for _, b in state.bodies]
    assert bodies[0]["prompt"] == [7, 8, 9] and bodies[0]["cache_salt"] == "tenant"
    assert bodies[1]["prompt"] == "the quick fox" and "cache_salt" not in bodies[1]
    assert bodies[2]["messages"] == msgs and bodies[2]["max_tokens"] == 3
    assert "prompt" not in bodies[2]
    assert [s["output_tokens"] for s in rep["samples"]] == [2, 2, 3]


def test_prediction_beside_what_the_server_delivered(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    state, url = fake
    tiny_llama = str(tmp_path / "config.json")  # 2 layers x 2 KV heads x 16 x K,V x fp16
    Path(tiny_llama).write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "vocab_size": 100,
                "torch_dtype": "float16",
            }
        )
    )
    # 256 B/token; chunks of 32 tokens: 8 KiB slots; a 5-slot tier; vLLM's cache holds 2
    # blocks, so two documents taking turns miss there and hit in the tier
    state.extra_metrics = (
        'kvtier:host_bytes_capacity{model_name="fake",engine="0"} 40960.0\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="2",engine="0"} 1.0\n'
    )
    docs = [[1, 2], [5, 6]]
    lines = [mooncake(i, docs[i % 2] + [100 + i, 200 + i, 300 + i], 70) for i in range(12)]
    path = _write(tmp_path / "t.jsonl", lines)
    rc, rep = _run(
        url,
        path,
        capsys,
        "--trace-block-size",
        "16",
        "--plan-model",
        tiny_llama,
        "--plan-chunk-size",
        "32",
        "--max-input-tokens",
        "64",
    )
    assert rc == 0
    p, d = rep["trace_replay"]["predicted"], rep["trace_replay"]["delivered"]
    assert p["host_tier_chunks"] == 5 and p["gpu_kv_tokens"] == 32
    assert p["gpu_kv_source"] == "vllm:cache_config_info"
    sim = tr.Simulation(16, 32, 2)
    for x in lines:
        sim.add(tr.truncate(tr.TraceRequest([], None, None, list(x["hash_ids"]), 70, 16), 64))
    assert p["host_hit_rate"] == pytest.approx(sim.served()[5] / sim.prompt_tokens)
    assert p["gpu_hit_rate"] == pytest.approx(sim.gpu_hit_tokens / sim.prompt_tokens)
    assert p["host_hit_rate"] == pytest.approx(10 * 32 / (12 * 64))  # all but the first two
    # the fake's counters: 30 of every 100 prompt tokens from kvtier's host tier
    assert d["host_hit_rate"] == pytest.approx(0.3)
    assert rep["trace_replay"]["host_difference_pp"] == pytest.approx(
        (0.3 - p["host_hit_rate"]) * 100
    )
    args = bench.build_parser().parse_args(
        [
            "--url",
            url,
            "--trace",
            str(path),
            "--trace-block-size",
            "16",
            "--plan-model",
            tiny_llama,
            "--plan-chunk-size",
            "32",
            "--max-input-tokens",
            "64",
        ]
    )
    assert bench.run(args) == 0
    table = capsys.readouterr().out
    assert (
        f"predicted {p['host_hit_rate'] * 100:.1f} % (kvtier size --trace, 5 chunks of "
        "32), delivered 30.0 %" in table
    )
    # vLLM's cache emptied before every request: the model gives it nothing
    rc, rep = _run(
        url,
        path,
        capsys,
        "--trace-block-size",
        "16",
        "--plan-model",
        tiny_llama,
        "--plan-chunk-size",
        "32",
        "--max-input-tokens",
        "64",
        "--reset-prefix-cache",
    )
    p = rep["trace_replay"]["predicted"]
    assert p["gpu_kv_tokens"] == 0 and p["gpu_hit_rate"] == 0
    sim = tr.Simulation(16, 32, 0)
    for x in lines:
        sim.add(tr.truncate(tr.TraceRequest([], None, None, list(x["hash_ids"]), 70, 16), 64))
    assert p["host_hit_rate"] == pytest.approx(sim.served()[5] / sim.prompt_tokens)
    # without --plan-model the table says why there is no prediction
    rc, rep = _run(url, path, capsys, "--trace-block-size", "16")
    assert rep["trace_replay"]["predicted"]["host_hit_rate"] is None
    assert "--plan-model" in rep["trace_replay"]["predicted"]["why_none"]


# ------------------------------------------------------------ bounds on what a line asks


def _peak_run(url: str, trace: Path, capsys: Any, *extra: str) -> tuple[int, dict[str, Any], int]:
    """The replay with tracemalloc on: its exit code, report and peak traced bytes."""
    tracemalloc.start()
    try:
        rc, rep = _run(url, trace, capsys, *extra)
        return rc, rep, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_hash_id_lines_without_input_length_are_bounded_not_expanded(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    """A few bytes of hash ids claim millions of tokens when a line has no input_length:
    over the reader's 2**24 they are bad lines; over the bound on one prompt (the server
    does not say its max_model_len here: 2**20) they are never expanded nor sent; the
    rest of the trace is replayed, every bound that acted counted."""
    state, url = fake
    big = tr.MAX_TRACE_BLOCK_SIZE  # 2**20 tokens an id
    lines = [
        mooncake(0, [1], 30),
        {"timestamp": 1, "hash_ids": [7] * 17},  # 17.8M tokens: over the reader's cap
        {"timestamp": 2, "hash_ids": [7, 8, 9]},  # 3.1M tokens: over the send bound
        {"timestamp": 3, "hash_ids": [8] * 3, "input_length": 2 * big + 1},
        mooncake(4, [3], 20),
    ]
    path = _write(tmp_path / "t.jsonl", lines)
    rc, rep, peak = _peak_run(
        url, path, capsys, "--trace-block-size", str(big), "--max-concurrency", "1"
    )
    assert rc == 0 and rep["requests"] == 2 and len(state.bodies) == 2
    assert [len(b["prompt"]) for _, b in state.bodies] == [30, 20]
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB traced: a line was expanded"
    b = rep["trace_replay"]["bounds"]
    assert b["input_tokens"] == 2**20 and b["input_source"].startswith("default")
    assert b["inputs_not_sent"] == 2 and b["inputs_cut"] == 0 and b["over_cap_lines"] == 1
    assert rep["trace_replay"]["bad_lines"] == 1
    assert (
        "the prompt (no input_length: 17 hash_ids x 1048576 tokens) is 17825792 tokens, "
        "over the 16777216-token bound on one prompt"
    ) in rep["trace_replay"]["bad_examples"][0]


def test_the_servers_max_model_len_bounds_prompts_and_max_input_tokens_cuts(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    """vLLM lists max_model_len in /v1/models: a longer prompt would be refused, so it is
    not sent (nor modelled); --max-input-tokens cuts instead. Both counted and shown."""
    state, url = fake
    state.max_model_len = 40
    lines = [
        mooncake(0, [1, 2], 30),
        mooncake(1, [1, 2, 3], 41),
        {"prompt_token_ids": list(range(50)), "timestamp": 0.002},
        {"prompt": "text is sent as it is", "timestamp": 0.003},
    ]
    path = _write(tmp_path / "t.jsonl", lines)
    rc, rep = _run(url, path, capsys, "--trace-block-size", "16", "--max-concurrency", "1")
    assert rc == 0 and rep["requests"] == 2
    assert [b["prompt"] for _, b in state.bodies][1] == "text is sent as it is"
    b = rep["trace_replay"]["bounds"]
    assert b["input_tokens"] == 40 and b["input_source"] == "the server's max_model_len"
    assert b["inputs_not_sent"] == 2 and b["inputs_cut"] == 0
    rc, rep = _run(
        url,
        path,
        capsys,
        "--trace-block-size",
        "16",
        "--max-concurrency",
        "1",
        "--max-input-tokens",
        "35",
        "--max-output-tokens",
        "1",
    )
    assert rc == 0 and rep["requests"] == 4
    b = rep["trace_replay"]["bounds"]
    assert b["input_source"] == "--max-input-tokens" and b["inputs_cut"] == 2
    assert b["inputs_not_sent"] == 0 and b["outputs_capped"] == 4  # 2 tokens each, to 1
    assert [len(b["prompt"]) for _, b in state.bodies[2:5]] == [30, 35, 35]
    # the table says what the bounds did
    args = bench.build_parser().parse_args(
        [
            "--url",
            url,
            "--trace",
            str(path),
            "--token-range",
            "5:480",
            "--output-tokens",
            "2",
            "--trace-block-size",
            "16",
        ]
    )
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "2 prompts over 40 tokens (the server's max_model_len) not sent" in out


def test_one_far_timestamp_does_not_stall_the_replay(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timestamp 30,000 years on (and one far before) must not make the replay sleep:
    every wait is at most --max-gap; the gap cut and the line out of order are counted.
    The sleep is recorded, not slept."""
    from kvtier.cli import bench_trace

    _, url = fake
    waits: list[float] = []
    monkeypatch.setattr(bench_trace, "sleep", waits.append)
    lines = [
        mooncake(0, [1], 10),
        mooncake(1e15, [2], 10),
        mooncake(300, [3], 10),
        mooncake(600, [4], 10),
        mooncake(-1e300, [5], 10),
        mooncake(900, [6], 10),
    ]
    path = _write(tmp_path / "t.jsonl", lines)
    rc, rep = _run(
        url, path, capsys, "--trace-block-size", "16", "--max-gap", "2", "--max-concurrency", "1"
    )
    assert rc == 0 and rep["requests"] == 6
    assert waits and max(waits) <= 2.0, waits
    b = rep["trace_replay"]["bounds"]
    assert b["max_gap_s"] == 2 and b["gaps_cut"] == 2 and b["timestamps_backwards"] == 2
    # after each stray line the trace keeps its pace (0.3 s), shifted by at most 2 s
    dues = sorted(s["due_s"] for s in rep["samples"])
    assert dues == pytest.approx([0, 2, 2, 2.3, 2.3, 4.3])


def test_the_schedule_bounds_every_gap() -> None:
    """The due times themselves, without a replay: the trace's gaps over --speedup, none
    over max_gap (an infinite one included), lines out of order due at once."""
    from kvtier.cli.bench_trace import Bounds, Schedule

    bounds = Bounds(100, "test", max_gap_s=5.0)
    s = Schedule(2.0, bounds)
    got = [s.next(t) for t in (10.0, 14.0, None, 13.0, 16.0, 1e308, -1e308, 1e308, 1e308 + 1e293)]
    # 13 is out of order by less than max_gap: due at once, 16 then 1 s after 14
    assert got == [0.0, 2.0, 2.0, 2.0, 3.0, 8.0, 8.0, 13.0, 18.0]
    assert bounds.gaps_cut == 3 and bounds.timestamps_backwards == 2


def test_hash_id_tokens_kept_for_reuse_are_bounded_in_tokens() -> None:
    """The cache of expanded hash ids holds tokens, not entries: 2**20-token blocks must
    not pile up (an lru_cache of 65,536 such blocks would hold 2**36 tokens)."""
    from kvtier.cli.bench_trace import BlockCache

    cache = BlockCache(5, 480, budget=4096)
    for h in range(40):
        assert cache.get(h, 1000) == tuple(tr.block_tokens(h, 1000, 5, 480))
    assert cache.held <= 4096
    assert cache.get(39, 1000) is cache.get(39, 1000)  # recent ones are kept
    assert len(cache.get(1, 10_000)) == 10_000 and cache.held <= 4096  # too big to keep


@pytest.mark.parametrize(
    "flags,why",
    [
        (("--max-gap", "-1"), "--max-gap"),
        (("--max-gap", "nan"), "--max-gap"),
        (("--max-gap", "1e9"), "--max-gap"),
        (("--max-input-tokens", str(2**24 + 1)), "--max-input-tokens"),
        (("--speedup", "0"), "--speedup"),
        (("--speedup", "nan"), "--speedup"),
        (("--speedup", "1e-300"), "--speedup"),
        (("--max-concurrency", "0"), "--max-concurrency"),
        (("--max-requests", "0"), "--max-requests"),
        (("--max-input-tokens", "-1"), "--max-input-tokens"),
        (("--token-range", "9:9"), "--token-range"),
        (("--token-range", "x"), "--token-range"),
        (("--trace-block-size", "0"), "--trace-block-size"),
        (("--trace-out", "x.jsonl"), "--trace-out"),
    ],
)
def test_bad_flags_exit_2(tmp_path: Path, capsys: Any, flags: tuple[str, str], why: str) -> None:
    path = _write(tmp_path / "t.jsonl", [mooncake(0, [1], 10)])
    args = bench.build_parser().parse_args(["--trace", str(path), *flags])
    assert bench.run(args) == 2
    assert why in capsys.readouterr().err


def test_missing_trace_exits_2(tmp_path: Path, capsys: Any) -> None:
    args = bench.build_parser().parse_args(["--trace", str(tmp_path / "nope.jsonl")])
    assert bench.run(args) == 2
    assert "cannot read the trace" in capsys.readouterr().err


def test_wired_as_kvtier_bench_trace(
    fake: tuple[FakeServer, str], tmp_path: Path, capsys: Any
) -> None:
    from kvtier.cli import main as cli

    _, url = fake
    path = _write(
        tmp_path / "t.jsonl",
        [
            {
                "chat_id": 1,
                "parent_chat_id": -1,
                "turn": 1,
                "timestamp": 0.0,
                "input_length": 20,
                "output_length": 1,
                "hash_ids": [4, 5],
            }
        ],
    )
    rc = cli.main(
        [
            "bench",
            "--url",
            url,
            "--trace",
            str(path),
            "--token-range",
            "5:480",
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "trace t.jsonl (bailian, 16 tokens per hash id) at 1x its rate" in out
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
