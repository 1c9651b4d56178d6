"""`kvtier size --trace` on hash-id traces (Mooncake, Qwen/Bailian).

A hash-id line names its prompt's blocks instead of its tokens. The planner derives
vLLM's blocks and kvtier's chunks from the ids without expanding them; every check here
compares that with the same trace expanded to tokens (each id its own tokens, as
``kvtier bench --trace`` sends them) and run through the token-id path, which
tests/sizing/trace/test_trace.py checks against LRU caches simulated one size at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import test_trace
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trace import COMMON, _run, _write, brute_served

from kvtier.cli.main import main
from kvtier.sizing import trace as tr
from kvtier.sizing.trace import read as trace_read

ROOT = Path(__file__).resolve().parents[3]
model_dir = test_trace.model_dir  # the fixture: a tiny Llama with a tokenizer
#: tokens of distinct ids never collide in so wide a range (the bench uses the vocabulary)
WIDE = (0, 2**40)


def expanded(req: tr.TraceRequest) -> tr.TraceRequest:
    return tr.TraceRequest(tr.expand_tokens(req, *WIDE), req.cache_salt)


@st.composite
def hash_traces(draw: Any, block: int) -> list[tr.TraceRequest]:
    """Sessions that extend earlier prompts (prefix-chained ids), ids reused after a
    different parent (not chained), partial last blocks, salts."""
    out: list[tr.TraceRequest] = []
    prompts: list[tuple[list[int], int]] = []
    for _ in range(draw(st.integers(1, 20))):
        if prompts and draw(st.booleans()):
            ids, n = prompts[draw(st.integers(0, len(prompts) - 1))]
            keep = draw(st.integers(0, n // block))  # its full blocks, then new ones
            ids = ids[:keep]
        else:
            ids = []
        extra = draw(st.lists(st.integers(0, 12), min_size=1, max_size=5))
        ids = ids + extra
        n = (len(ids) - 1) * block + draw(st.integers(1, block))
        salt = draw(st.sampled_from([None, None, None, "t"]))
        prompts.append((ids, n))
        out.append(tr.TraceRequest([], salt, None, ids, n, block, None, "mooncake"))
    return out


def _sizes() -> Any:
    """(vLLM block, chunk, trace block): chunk a multiple of vLLM's block, and the chunk
    a multiple of the trace block or the trace block a multiple of the chunk."""
    return st.sampled_from(
        [
            (1, 2, 1),
            (1, 2, 2),
            (2, 4, 1),
            (2, 4, 8),
            (2, 2, 6),
            (1, 3, 6),
            (2, 6, 3),
            (4, 8, 16),
            (3, 6, 2),
            (2, 8, 4),
        ]
    )


@settings(max_examples=200, deadline=None)
@given(data=st.data(), sizes=_sizes(), gpu_blocks=st.integers(0, 12))
def test_hash_ids_plan_as_their_tokens_would(
    data: Any, sizes: tuple[int, int, int], gpu_blocks: int
) -> None:
    bs, cs, block = sizes
    reqs = data.draw(hash_traces(block))
    by_ids, by_tokens = tr.Simulation(bs, cs, gpu_blocks), tr.Simulation(bs, cs, gpu_blocks)
    for r in reqs:
        by_ids.add(r)
        by_tokens.add(expanded(r))
    assert by_ids.prompt_tokens == by_tokens.prompt_tokens == sum(r.length for r in reqs)
    assert by_ids.gpu_hit_tokens == by_tokens.gpu_hit_tokens
    assert by_ids.served() == by_tokens.served()
    assert by_ids.distinct_chunks == by_tokens.distinct_chunks
    assert by_ids.max_request_chunks == by_tokens.max_request_chunks
    # and against the caches simulated as lists, keyed by the whole token prefix
    toks = [(expanded(r).token_ids, r.cache_salt) for r in reqs]
    served = by_ids.served()
    for slots in (1, 2, 5, by_ids.distinct_chunks + 1):
        gpu, want = brute_served(toks, bs, cs, gpu_blocks, slots)
        assert by_ids.gpu_hit_tokens == gpu
        assert served[min(slots, len(served) - 1)] == want


def test_block_tokens_are_a_function_of_the_id_in_any_process() -> None:
    a = tr.block_tokens(7, 16, 5, 480)
    assert a == tr.block_tokens(7, 16, 5, 480) and all(5 <= t < 480 for t in a)
    assert a != tr.block_tokens(8, 16, 5, 480)
    code = "from kvtier.sizing.trace import block_tokens; print(block_tokens(7, 16, 5, 480))"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "123"},
        check=True,
    )
    assert json.loads(other.stdout) == a
    req = tr.TraceRequest([], None, None, [3, 4, 5], 40, 16)
    toks = tr.expand_tokens(req, 5, 480)
    assert toks == (
        tr.block_tokens(3, 16, 5, 480)
        + tr.block_tokens(4, 16, 5, 480)
        + tr.block_tokens(5, 16, 5, 480)[:8]
    )


def test_truncation_keeps_shared_prefixes_shared() -> None:
    reqs = [
        tr.TraceRequest([], None, None, ids, n, 8)
        for ids, n in (([1, 2, 3, 4], 30), ([1, 2, 3, 9], 27), ([1, 5], 12), ([1, 2], 16))
    ]
    for limit in (5, 8, 13, 20, 100):
        sim_ids, sim_tok = tr.Simulation(2, 4, 3), tr.Simulation(2, 4, 3)
        for r in reqs:
            full = expanded(r).token_ids
            cut = tr.truncate(
                tr.TraceRequest([], None, None, list(r.hash_ids or []), r.length, 8), limit
            )
            assert cut.prompt_tokens == min(r.length, limit)
            assert len(cut.hash_ids or []) == -(-cut.length // 8)
            sim_ids.add(cut)
            sim_tok.add(tr.TraceRequest(full[:limit]))
        assert sim_ids.served() == sim_tok.served()
        assert sim_ids.gpu_hit_tokens == sim_tok.gpu_hit_tokens


# ------------------------------------------------------------------- the formats


def mooncake(ts_ms: int, ids: list[int], n: int, out: int = 10) -> dict[str, Any]:
    return {"timestamp": ts_ms, "input_length": n, "output_length": out, "hash_ids": ids}


def bailian(
    ts_s: float, ids: list[int], n: int, chat: int, parent: int = -1, turn: int = 1
) -> dict[str, Any]:
    return {
        "chat_id": chat,
        "parent_chat_id": parent,
        "timestamp": ts_s,
        "input_length": n,
        "output_length": 7,
        "type": "text",
        "turn": turn,
        "hash_ids": ids,
    }


def test_mooncake_lines_are_512_token_blocks_and_milliseconds(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    lines = [mooncake(1000 * i, [0, 1, 2 + i], 1100 + i, out=20) for i in range(10)]
    path = _write(tmp_path / "mc.jsonl", lines)
    rc, rep = _run(
        capsys,
        "--model",
        str(model_dir),
        "--trace",
        str(path),
        "--gpu-kv-tokens",
        "0",
        "--chunk-size",
        "256",
        "--json",
    )
    assert rc == 0
    t = rep["trace"]
    assert t["format"] == "mooncake" and t["block_size"] == 512
    assert t["requests"] == 10 and t["prompt_tokens"] == sum(1100 + i for i in range(10))
    assert t["duration_s"] == 9.0 and t["requests_per_s"] == pytest.approx(10 / 9)
    assert t["output_tokens"] == 200 and t["output_tokens_per_s"] == pytest.approx(200 / 9)
    # the two shared 512-token blocks are 4 chunks of 256: every later request has them
    assert rep["max_hit_rate"] == pytest.approx(9 * 1024 / t["prompt_tokens"])
    sim = tr.Simulation(16, 256, 0)
    for line in lines:
        sim.add(
            tr.TraceRequest(
                tr.expand_tokens(
                    tr.TraceRequest([], None, None, line["hash_ids"], line["input_length"], 512),
                    *WIDE,
                )
            )
        )
    assert rep["max_hit_rate"] == pytest.approx(sim.served()[-1] / sim.prompt_tokens)
    iso = _write(
        tmp_path / "iso.jsonl",
        [
            {**lines[0], "timestamp": "2025-01-01T00:00:00"},
            {**lines[1], "timestamp": "2025-01-01T00:00:30"},
        ],
    )
    _, rep = _run(
        capsys, "--model", str(model_dir), "--trace", str(iso), "--chunk-size", "256", "--json"
    )
    assert rep["trace"]["duration_s"] == 30.0  # an ISO 8601 time is not milliseconds
    _, text = _run(capsys, "--model", str(model_dir), "--trace", str(path), "--chunk-size", "256")
    assert "format           mooncake, 512 tokens per hash id" in text
    assert "1.11 requests/s over 9 s" in text


def test_bailian_lines_are_16_token_blocks_and_seconds(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    lines = [
        bailian(0.5, [1, 2, 3], 40, 1),
        bailian(2.5, [1, 2, 3, 4, 5], 70, 2, 1, 2),
        bailian(4.5, [9], 10, 3),
    ]
    path = _write(tmp_path / "bl.jsonl", lines)
    rc, rep = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON)
    assert rc == 0
    t = rep["trace"]
    assert t["format"] == "bailian" and t["block_size"] == 16 and t["duration_s"] == 4.0
    assert t["bad_lines"] == 0 and t["prompt_tokens"] == 120 and t["output_tokens"] == 21
    # the second request has the first one's 3 ids: its 40 tokens (the third block was
    # partial: its first 8 tokens), 5 chunks of 8
    assert rep["max_hit_rate"] == pytest.approx(40 / 120)
    # as Mooncake lines (--trace-format) the same ids are 512-token blocks: 40 tokens are
    # not 3 of them (10 tokens are 1)
    rc, rep = _run(
        capsys,
        "--model",
        str(model_dir),
        "--trace",
        str(path),
        *COMMON,
        "--trace-format",
        "mooncake",
    )
    assert rc == 0 and rep["trace"]["bad_lines"] == 2 and rep["trace"]["requests"] == 1
    assert (
        "is 1 blocks of 512 tokens but the line has 3 hash_ids" in rep["trace"]["bad_examples"][0]
    )
    # --trace-block-size overrides what the format implies
    rc, rep = _run(
        capsys,
        "--model",
        str(model_dir),
        "--trace",
        str(path),
        *COMMON,
        "--trace-format",
        "mooncake",
        "--trace-block-size",
        "16",
    )
    assert rc == 0 and rep["trace"]["format"] == "mooncake" and rep["trace"]["block_size"] == 16
    assert rep["max_hit_rate"] == pytest.approx(40 / 120)


def test_formats_detected_per_line_or_forced(model_dir: Path, tmp_path: Path, capsys: Any) -> None:
    ids = list(range(40))
    lines = [
        {"prompt_token_ids": ids},
        {"prompt": ids},
        bailian(1, [1, 2], 20, 1),
        mooncake(5, [4], 100),
        {"prompt_token_ids": ids},
    ]
    path = _write(tmp_path / "mixed.jsonl", lines)
    rc, rep = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON)
    assert rc == 0
    assert rep["trace"]["format"] == "mixed" and rep["trace"]["block_size"] == [16, 512]
    assert rep["trace"]["formats"] == {"tokens": 3, "bailian": 1, "mooncake": 1}
    rc, rep = _run(
        capsys, "--model", str(model_dir), "--trace", str(path), *COMMON, "--trace-block-size", "16"
    )  # the Mooncake line's 100 tokens: 7 ids
    assert rc == 0 and rep["trace"]["block_size"] == 16
    assert rep["trace"]["formats"] == {"tokens": 3, "bailian": 1}
    assert rep["trace"]["bad_lines"] == 1
    rc, rep = _run(
        capsys, "--model", str(model_dir), "--trace", str(path), *COMMON, "--trace-format", "tokens"
    )
    assert rc == 0 and rep["trace"]["requests"] == 3 and rep["trace"]["bad_lines"] == 2
    assert "a bailian line, not tokens (--trace-format)" in rep["trace"]["bad_examples"][0]


def test_bad_hash_id_lines_are_counted(model_dir: Path, tmp_path: Path, capsys: Any) -> None:
    good = bailian(1, [1, 2, 3], 40, 1)
    lines = [
        good,
        {**good, "hash_ids": []},
        {**good, "hash_ids": [1, -2, 3]},
        {**good, "hash_ids": [1, True, 3]},
        {**good, "hash_ids": [1, 2**64, 3]},
        {**good, "hash_ids": "123"},
        {**good, "input_length": 0},
        {**good, "input_length": 2**40},
        {**good, "input_length": 60},
        {**good, "output_length": -1},
        {**good, "timestamp": "soon"},
        '{"hash_ids": [1], "input_length": ' + "9" * 400 + "}",
        {k: v for k, v in good.items() if k != "input_length"},
    ]
    path = _write(tmp_path / "bad.jsonl", lines)
    rc, out = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON[:-1])
    assert rc == 0 and "2 requests" in out and "11 bad lines" in out
    assert "line 2: hash_ids is not a non-empty list of integers" in out
    reasons = []
    for line in lines[1:-1]:
        with pytest.raises(trace_read._BadLine) as e:
            tr.parse_line(line if isinstance(line, str) else json.dumps(line), None)
        reasons.append(str(e.value))
    assert (
        "input_length 60 is 4 blocks of 16 tokens but the line has 3 hash_ids (is the "
        "trace block size 16? --trace-block-size)" in reasons
    )
    assert "input_length is not an integer in [1, 16777216]" in reasons
    assert "output_length is not an integer in [0, 16777216]" in reasons


@pytest.mark.parametrize(
    "flags,why",
    [
        (
            ("--chunk-size", "24", "--block-size", "8", "--trace-block-size", "16"),
            "one must be a multiple of the other",
        ),
        (
            ("--chunk-size", "24", "--block-size", "8", "--trace-format", "bailian"),
            "one must be a multiple of the other",
        ),
        (("--trace-block-size", "0"), "--trace-block-size must be from 1"),
    ],
)
def test_chunk_and_trace_blocks_that_do_not_fit_are_usage_errors(
    model_dir: Path, tmp_path: Path, capsys: Any, flags: tuple[str, ...], why: str
) -> None:
    path = _write(tmp_path / "t.jsonl", [bailian(1, [1, 2, 3], 40, 1)])
    assert main(["size", "--model", str(model_dir), "--trace", str(path), *flags]) == 2
    assert why in capsys.readouterr().err
    # found while reading (format detected from the lines): the same error, exit 2
    assert (
        main(
            [
                "size",
                "--model",
                str(model_dir),
                "--trace",
                str(path),
                "--chunk-size",
                "24",
                "--block-size",
                "8",
            ]
        )
        == 2
    )
    assert "16-token hash blocks: one must be a multiple" in capsys.readouterr().err


def test_bench_trace_generator_writes_mooncake_lines(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import trace_replay

    shape = trace_replay.HashTraceShape(requests=300, seed=3)
    path = tmp_path / "mc.jsonl"
    total = trace_replay.generate_hash_trace(path, shape)
    stats = tr.TraceStats()
    reqs = list(tr.read_trace(str(path), None, stats))
    assert stats.bad_lines == 0 and len(reqs) == 300 and stats.formats == {"mooncake": 300}
    assert sum(r.length for r in reqs) == total
    assert total / 300 == pytest.approx(12_000, rel=0.25)  # Mooncake's mean prompt
    # later turns keep the full blocks of the session's earlier prompt
    seen = {tuple(r.hash_ids or [])[: r.length // 512] for r in reqs}
    assert sum(any(len(p) < len(q) and q[: len(p)] == p for q in seen) for p in seen if p) > 50


# ------------------------------------------------------------ speed and memory


@pytest.mark.timing
def test_mooncake_sized_trace_in_30_s_and_300_mb(tmp_path: Path) -> None:
    """12,000 requests, about 145M prompt tokens (Mooncake's conversation trace), planned
    by the CLI as a user runs it, vLLM's cache as an 80 GB GPU gives it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import trace_replay

    path = tmp_path / "mooncake.jsonl"
    total = trace_replay.generate_hash_trace(path, trace_replay.HashTraceShape())
    assert 140e6 < total < 150e6
    # the CLI in a fresh process, which reports its own peak RSS at exit (VmHWM: Linux
    # carries ru_maxrss over exec, so the forked test process's would count)
    code = (
        "import re, sys; from kvtier.cli.main import main; rc = main(sys.argv[1:]); "
        "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()); "
        "print('maxrss', hwm.group(1), file=sys.stderr); sys.exit(rc)"
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "size",
            "--model",
            str(ROOT / "tests" / "fixtures" / "models" / "llama3-8b"),
            "--gpu-memory",
            "80",
            "--trace",
            str(path),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    wall = time.monotonic() - t0
    rss_mb = int(proc.stderr.split("maxrss ")[-1].split()[0]) / 1024
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    assert rep["trace"]["requests"] == 12_000 and rep["trace"]["prompt_tokens"] == total
    assert wall <= 30, wall
    assert rss_mb <= 300, rss_mb


def test_emit_from_a_trace_puts_the_recommended_host_tier_in_the_config(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    docs = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    lines = [mooncake(i, docs[i % 3] + [100 + i], 70) for i in range(30)]
    path = _write(tmp_path / "t.jsonl", lines)
    common = (
        "--model",
        str(model_dir),
        "--trace",
        str(path),
        "--trace-block-size",
        "16",
        "--chunk-size",
        "32",
        "--gpu-kv-tokens",
        "0",
        "--target-hit-rate",
        "0.5",
    )
    rc, rep = _run(capsys, *common, "--json")
    assert rc == 0 and rep["recommended"]["host_bytes"]
    assert main(["size", *common, "--emit", "kv-transfer-config"]) == 0
    out = capsys.readouterr()
    cfg = json.loads(out.out)  # stdout is the config alone; the curves went to stderr
    extra = cfg["kv_connector_extra_config"]
    assert extra["cpu_bytes"] == rep["recommended"]["host_bytes"] and extra["chunk_size"] == 32
    assert "host tier / worker" in out.err
    # out of reach: the size where the curve stops rising, and a warning
    assert main(["size", *common[:-1], "0.99", "--emit", "kv-transfer-config"]) == 0
    out = capsys.readouterr()
    top = rep["host_tier"][-1]["hit_rate"]
    first_top = next(p["bytes"] for p in rep["host_tier"] if p["hit_rate"] >= top)
    assert json.loads(out.out)["kv_connector_extra_config"]["cpu_bytes"] == first_top
    assert "never reaches 99 %" in out.err


# --------------------------------------------------- bounds on what a line claims


def _planned_peak(path: Path, form: tr.TraceFormat) -> tuple[tr.Simulation, tr.TraceStats, int]:
    """plan_trace under tracemalloc: the simulation, the stats and the peak traced bytes."""
    tracemalloc.start()
    try:
        sim, stats = tr.plan_trace(
            str(path), tokenizer=None, block_size=16, chunk_size=512, gpu_kv_tokens=4096, form=form
        )
        return sim, stats, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_hash_ids_without_input_length_are_bounded_as_input_length_is(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """A line without input_length is len(hash_ids) x block size tokens: a 120 KB line of
    40,000 ids claims 20M Mooncake tokens (a 1.5 MB trace made 1.16 GB of keys). Such a
    prompt is over the 2**24 bound input_length has: a bad line, counted as over a bound,
    never keyed; memory stays that of the good lines."""
    good = [mooncake(1000 * i, [i, 100 + i], 1000) for i in range(3)]
    hostile = [{"timestamp": 5000 + i, "hash_ids": [i] * 40_000} for i in range(5)]
    path = _write(tmp_path / "t.jsonl", [good[0], *hostile, *good[1:]])
    assert path.stat().st_size < 2**20
    sim, stats, peak = _planned_peak(path, tr.TraceFormat())
    assert sim.prompt_tokens == 3000 and stats.requests == 3
    assert stats.bad_lines == stats.over_cap == 5
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB traced for a {path.stat().st_size} B trace"
    assert stats.bad_examples[0] == (
        "line 2: the prompt (no input_length: 40000 hash_ids x 512 tokens) is 20480000 "
        "tokens, over the 16777216-token bound on one prompt"
    )
    rc, rep = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON)
    assert rc == 0 and rep["trace"]["over_cap_lines"] == 5 and rep["trace"]["requests"] == 3
    rc, out = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON[:-1])
    assert "over bounds      5 of the bad lines: a prompt over 16777216 tokens" in out


def test_every_length_a_hash_id_line_gives_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the bound a line is read; one token or id over it is a bad line over a bound."""
    cap, big = tr.MAX_INPUT_LENGTH, tr.MAX_TRACE_BLOCK_SIZE
    form = tr.TraceFormat(block_size=big)
    at = tr.parse_line(json.dumps({"hash_ids": [1] * (cap // big)}), None, form)
    assert at.length == cap
    for line in (
        {"hash_ids": [1] * (cap // big + 1)},
        {"hash_ids": [1], "input_length": cap + 1},
        {"hash_ids": [1], "output_length": cap + 1},
    ):
        with pytest.raises(trace_read._OverCap):
            tr.parse_line(json.dumps(line), None, form)
    # more ids than the bound has tokens: refused before the ids are looked at
    monkeypatch.setattr(trace_read, "MAX_INPUT_LENGTH", 100)
    with pytest.raises(trace_read._OverCap, match="a token an id at least"):
        tr.parse_line(
            json.dumps({"hash_ids": [1] * 101, "input_length": 100}),
            None,
            tr.TraceFormat(block_size=1),
        )
