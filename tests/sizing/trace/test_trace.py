"""`kvtier size --trace`: hit-rate curves from a request trace.

The curve from one pass of stack distances is checked against LRU caches simulated
one size at a time, with chunk identity taken from the token prefixes themselves (not
from kvtier's hashes), so both the key chain and the stack arithmetic are under test.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sizing_helpers import TINY_LLAMA, tiny_llama_tensors, write_model

from kvtier.cli.main import main
from kvtier.keys import chunk_block_hashes, token_block_hashes
from kvtier.sizing import trace as tr

# ------------------------------------------------------------------ brute force


def brute_served(
    reqs: list[tuple[list[int], str | None]], bs: int, cs: int, gpu_blocks: int, slots: int
) -> tuple[int, int]:
    """(tokens vLLM's cache serves, tokens a tier of ``slots`` chunks serves beyond it),
    simulating both caches as plain lists, keyed by (salt, the whole token prefix)."""
    gpu: list[Any] = []
    tier: list[Any] = []
    gpu_served = served = 0
    for ids, salt in reqs:
        n = len(ids)
        cap = (n - 1) // bs * bs
        blocks = [(salt, tuple(ids[: (i + 1) * bs])) for i in range(n // bs)]
        hit = 0
        if gpu_blocks:
            while hit < min(len(blocks), cap // bs) and blocks[hit] in gpu:
                hit += 1
            for b in reversed(blocks):
                if b in gpu:
                    gpu.remove(b)
                gpu.append(b)
            del gpu[: max(0, len(gpu) - gpu_blocks)]
        local = hit * bs
        gpu_served += local
        chunks = [(salt, tuple(ids[: (c + 1) * cs])) for c in range(n // cs)]
        end = local // cs
        while end < len(chunks) and end * cs < cap and chunks[end] in tier:
            end += 1
        served += max(0, min(end * cs, cap) - local)
        for k in chunks:
            if k in tier:
                tier.remove(k)
            tier.append(k)
            del tier[: max(0, len(tier) - slots)]
    return gpu_served, served


@st.composite
def traces(draw: Any) -> list[tuple[list[int], str | None]]:
    docs = draw(
        st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1, max_size=4)
    )
    out = []
    for _ in range(draw(st.integers(1, 25))):
        doc = docs[draw(st.integers(0, len(docs) - 1))]
        tail = draw(st.lists(st.integers(0, 3), max_size=10))
        salt = draw(st.sampled_from([None, None, "a", "b"]))
        ids = doc + tail
        if ids:
            out.append((ids, salt))
    return out


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    bs=st.sampled_from([1, 2, 3]),
    bpc=st.sampled_from([1, 2]),
    gpu_blocks=st.integers(0, 10),
)
def test_curve_matches_lru_simulated_at_every_size(
    data: Any, bs: int, bpc: int, gpu_blocks: int
) -> None:
    reqs = data.draw(traces())
    cs = bs * bpc
    sim = tr.Simulation(bs, cs, gpu_blocks)
    for ids, salt in reqs:
        sim.add(tr.TraceRequest(list(ids), salt))
    served = sim.served()
    assert sim.prompt_tokens == sum(len(ids) for ids, _ in reqs)
    for slots in range(1, sim.distinct_chunks + 3):
        gpu, want = brute_served(reqs, bs, cs, gpu_blocks, slots)
        assert sim.gpu_hit_tokens == gpu
        assert served[min(slots, len(served) - 1)] == want, slots


def test_lru_stack_depths_with_renumbering_and_forgetting() -> None:
    rng = random.Random(3)
    stack = tr.LruStack(limit=6)
    order: list[int] = []  # most recent last
    for _ in range(3000):  # many times the timestamp space: renumbers often
        key = rng.randrange(14)
        for probe in range(14):
            want = len(order) - order.index(probe) if probe in order else None
            assert stack.depth(probe) == want
        stack.access(key)
        if key in order:
            order.remove(key)
        order.append(key)
        del order[: max(0, len(order) - 6)]
        assert len(stack) == len(order)


def test_keys_chain_salt_and_prefix_as_the_connector_cuts_them() -> None:
    a = token_block_hashes(list(range(40)), 4)
    b = token_block_hashes(list(range(40)) + [7, 7], 4)
    c = token_block_hashes([99] + list(range(1, 40)), 4)
    salted = token_block_hashes(list(range(40)), 4, cache_salt="tenant")
    assert len(a) == 10 and a == b[:10]  # a partial last block has no hash
    assert not set(a) & set(c)  # one token differs in block 0: every later block differs
    assert not set(a) & set(salted)
    assert chunk_block_hashes(a, 2) == [a[1], a[3], a[5], a[7], a[9]]


# ------------------------------------------------------------------------- CLI


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tiny Llama config with a word-level tokenizer that has a BOS and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    d = Path(write_model(tmp_path / "m", TINY_LLAMA, tiny_llama_tensors()))
    words = "the quick brown fox jumps over lazy dog system user assistant : hello doc".split()
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
        "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
    )
    fast.save_pretrained(d)
    return d


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice("the quick brown fox jumps over lazy dog".split()) for _ in range(n))


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _run(capsys: Any, *argv: str) -> tuple[int, Any]:
    rc = main(["size", *argv])
    out = capsys.readouterr().out
    return rc, (json.loads(out) if "--json" in argv else out)


def _docs_trace(rng: random.Random, n: int) -> list[str]:
    docs = [_words(rng, 60) for _ in range(5)]
    return [rng.choice(docs) + " " + _words(rng, rng.randrange(1, 30)) for _ in range(n)]


COMMON = ("--gpu-kv-tokens", "32", "--block-size", "4", "--chunk-size", "8", "--json")


def test_text_prompts_and_messages_tokenize_as_vllm(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = _docs_trace(random.Random(1), 60)
    as_text = _write(tmp_path / "text.jsonl", [{"prompt": t} for t in texts])
    as_ids = _write(
        tmp_path / "ids.jsonl", [{"prompt_token_ids": tok(t)["input_ids"]} for t in texts]
    )
    assert tok(texts[0])["input_ids"][0] == tok.bos_token_id
    msgs = [
        [{"role": "system", "content": t.split(" ", 40)[-1]}, {"role": "user", "content": "hello"}]
        for t in texts
    ]
    as_msgs = _write(tmp_path / "msgs.jsonl", [{"messages": m} for m in msgs])
    rendered = [
        tok(
            tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
        for m in msgs
    ]
    as_rendered = _write(
        tmp_path / "rendered.jsonl", [{"prompt_token_ids": ids} for ids in rendered]
    )
    reps = {}
    for name, path in (
        ("text", as_text),
        ("ids", as_ids),
        ("msgs", as_msgs),
        ("rendered", as_rendered),
    ):
        rc, rep = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON)
        assert rc == 0
        rep["trace"].pop("path")
        assert rep["trace"].pop("format") == {
            "rendered": "tokens",
            "ids": "tokens",
            "msgs": "messages",
        }.get(name, name)
        rep["trace"].pop("formats")
        reps[name] = rep
    assert reps["text"]["trace"]["prompt_tokens"] > 60 * 60
    assert reps["text"]["max_hit_rate"] > 0.3
    assert reps["text"] == reps["ids"]
    assert reps["msgs"] == reps["rendered"]
    assert reps["msgs"] != reps["text"]


def test_cache_salt_and_timestamps(model_dir: Path, tmp_path: Path, capsys: Any) -> None:
    rng = random.Random(2)
    ids = [[rng.randrange(100) for _ in range(64)] for _ in range(3)]
    plain = _write(
        tmp_path / "plain.jsonl",
        [{"prompt_token_ids": ids[i % 3], "timestamp": i} for i in range(30)],
    )
    salted = _write(
        tmp_path / "salted.jsonl",
        [
            {
                "prompt_token_ids": ids[i % 3],
                "cache_salt": f"t{i}",
                "timestamp": f"2025-01-01T00:00:{i:02d}",
            }
            for i in range(30)
        ],
    )
    _, a = _run(capsys, "--model", str(model_dir), "--trace", str(plain), *COMMON)
    _, b = _run(capsys, "--model", str(model_dir), "--trace", str(salted), *COMMON)
    assert a["max_hit_rate"] > 0.8 and a["trace"]["duration_s"] == 29
    assert b["max_hit_rate"] == 0 and b["trace"]["duration_s"] == 29  # every salt its own


def test_bad_lines_are_counted_not_fatal(model_dir: Path, tmp_path: Path, capsys: Any) -> None:
    good = {"prompt_token_ids": list(range(40))}
    lines = [
        good,
        "not json",
        "[1, 2]",
        {"prompt_token_ids": [1, -2]},
        {"prompt_token_ids": ["a"]},
        {"prompt": 5},
        {"foo": 1},
        {"prompt_token_ids": []},
        {**good, "cache_salt": 3},
        {**good, "timestamp": "yesterday"},
        {"messages": "hi"},
        "",
        good,
    ]
    path = _write(tmp_path / "bad.jsonl", lines)
    rc, rep = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON)
    assert rc == 0
    assert rep["trace"]["requests"] == 2
    assert rep["trace"]["bad_lines"] == 10  # the blank line is not a request, nor bad
    assert rep["trace"]["bad_examples"][0].startswith("line 2: not JSON")
    assert len(rep["trace"]["bad_examples"]) == 5
    assert capsys.readouterr().err == ""  # the warning went with the JSON run's stderr
    only_bad = _write(tmp_path / "allbad.jsonl", ["nope", "{}"])
    rc, out = _run(capsys, "--model", str(model_dir), "--trace", str(only_bad))
    assert rc == 2 and "2 bad lines" in out


def test_text_prompt_without_tokenizer_is_an_error(tmp_path: Path, capsys: Any) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    path = _write(tmp_path / "t.jsonl", [{"prompt": "the fox"}])
    assert main(["size", "--model", str(cfg), "--trace", str(path)]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert main(["size", "--model", str(cfg), "--trace", str(tmp_path / "missing")]) == 2


SCHEMA = {
    "type": "object",
    "required": ["trace", "host_tier", "object_tier", "recommended", "gpu_prefix_cache"],
    "properties": {
        "trace": {
            "type": "object",
            "required": ["requests", "bad_lines", "prompt_tokens"],
            "properties": {
                k: {"type": "integer", "minimum": 0}
                for k in ("requests", "bad_lines", "prompt_tokens")
            },
        },
        "host_tier": {
            "type": "array",
            "minItems": 2,
            "items": {
                "type": "object",
                "required": ["bytes", "hit_rate"],
                "properties": {
                    "bytes": {"type": "integer", "minimum": 1},
                    "hit_rate": {"type": "number", "minimum": 0, "maximum": 1},
                },
            },
        },
        "recommended": {
            "type": "object",
            "required": ["host_bytes", "object_bytes"],
            "properties": {"host_bytes": {"type": ["integer", "null"]}},
        },
    },
}


def test_json_schema_bytes_per_worker_and_recommendation(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    rng = random.Random(5)
    docs = [[rng.randrange(100) for _ in range(200)] for _ in range(20)]
    path = _write(
        tmp_path / "t.jsonl", [{"prompt_token_ids": rng.choice(docs) + [1, 2]} for _ in range(400)]
    )
    args = (
        "--model",
        str(model_dir),
        "--trace",
        str(path),
        "--gpu-kv-tokens",
        "0",
        "--block-size",
        "16",
        "--chunk-size",
        "32",
        "--target-hit-rate",
        "0.5",
        "--json",
    )
    rc, one = _run(capsys, *args)
    _, two = _run(capsys, *args, "--tp", "2")
    assert rc == 0
    jsonschema.validate(one, SCHEMA)
    rates = [p["hit_rate"] for p in one["host_tier"]]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(one["max_hit_rate"])
    # TINY_LLAMA: 2 layers x 2 KV heads x 16 dims x K,V x fp16 = 256 B/token; 32-token chunks
    assert one["keys"]["host_slot_bytes"] == 8192  # 8 KiB, a multiple of the 4 KiB alignment
    assert [p["bytes"] for p in two["host_tier"]] == [p["bytes"] // 2 for p in one["host_tier"]]
    assert [p["hit_rate"] for p in two["host_tier"]] == rates
    rec = one["recommended"]
    assert rec["host_bytes"] % 8192 == 0
    chunks = rec["host_bytes"] // 8192
    # the recommended size reaches the target and one chunk less does not
    sim = tr.Simulation(16, 32, 0)
    for line in path.read_text().splitlines():
        sim.add(tr.TraceRequest(json.loads(line)["prompt_token_ids"]))
    served = sim.served()
    assert served[chunks] >= 0.5 * sim.prompt_tokens > served[chunks - 1]
    _, unreachable = _run(capsys, *args[:-3], "--target-hit-rate", "1", "--json")
    assert unreachable["recommended"]["host_bytes"] is None


def test_sizes_below_the_longest_prompt_are_flagged(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    # the connector keeps the first chunks of a prompt longer than the tier (its own
    # step's loads and stores cannot be evicted), the LRU model its last: only from the
    # longest prompt's chunk count on is the curve exact (tests/e2e/test_trace_replay.py)
    rng = random.Random(7)
    lens = [40, 72, 200, 56]  # the longest: 200 tokens = 25 chunks of 8 (199 loadable)
    prompts = [[rng.randrange(9) for _ in range(n)] for n in lens]
    path = _write(tmp_path / "t.jsonl", [{"prompt_token_ids": p} for p in prompts * 3])
    _, rep = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON)
    assert rep["trace"]["max_request_chunks"] == 25
    # TINY_LLAMA: 256 B/token, 8-token chunks: 2 KiB, aligned to one 4 KiB slot
    assert rep["host_tier_exact_from_bytes"] == 25 * 4096
    flags = [(p["chunks"], p["below_longest_prompt"]) for p in rep["host_tier"]]
    assert all(below == (chunks < 25) for chunks, below in flags)
    assert {below for _, below in flags} == {True, False}
    _, text = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON[:-1])
    assert "smaller than the longest prompt's chunks (100.00 KiB)" in text
    rows = [ln for ln in text.splitlines() if ln.rstrip().endswith(" %") or ln.endswith("  *")]
    assert rows[0].endswith("  *") and not rows[-1].endswith("  *"), rows


def test_gpu_cache_size_from_the_plan_and_text_and_plot(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    rng = random.Random(6)
    path = _write(
        tmp_path / "t.jsonl", [{"prompt_token_ids": [rng.randrange(9) for _ in range(80)]}] * 5
    )
    _, rep = _run(
        capsys, "--model", str(model_dir), "--trace", str(path), "--gpu-memory", "4", "--json"
    )
    assert rep["gpu_prefix_cache"]["source"] == "the plan"
    assert rep["gpu_prefix_cache"]["tokens"] > 10_000
    assert rep["gpu_prefix_cache"]["hit_rate"] == pytest.approx(4 * 64 / 400)
    png = tmp_path / "curve.png"
    rc, text = _run(capsys, "--model", str(model_dir), "--trace", str(path), "--plot", str(png))
    assert rc == 0 and "host tier / worker" in text and "unknown, taken as 0" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------- bounded memory


def _big_trace(path: Path, n: int) -> Path:
    """``n`` distinct 64-token prompts, written line by line."""
    with path.open("w") as f:
        for i in range(n):
            f.write(
                json.dumps({"prompt_token_ids": [i % 997, i // 997] * 32, "timestamp": i}) + "\n"
            )
    return path


def _peak(path: Path) -> int:
    tracemalloc.start()
    try:
        sim, stats = tr.plan_trace(
            str(path),
            tokenizer=None,
            block_size=16,
            chunk_size=16,
            gpu_kv_tokens=256,
            max_chunks=500,
        )
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_large_trace_is_streamed_in_bounded_memory(tmp_path: Path) -> None:
    small = _big_trace(tmp_path / "small.jsonl", 3_000)
    big = _big_trace(tmp_path / "big.jsonl", 24_000)
    p_small, p_big = _peak(small), _peak(big)
    assert big.stat().st_size > 3 * 2**20
    assert p_big < big.stat().st_size / 10  # the file is never held in memory
    assert p_big < 1.3 * p_small + 256 * 1024  # 8x the requests, about the same memory


@pytest.fixture
def bench_url() -> Any:
    """The fake OpenAI-compatible server the bench tests use, started for this test."""
    from fake_openai import FakeServer, serving

    with serving(FakeServer()) as url:
        yield url


def test_bench_writes_a_trace_the_planner_reads(
    bench_url: str, model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    from fake_openai import bench_args

    from kvtier.cli import bench

    url = bench_url
    out = tmp_path / "bench.jsonl"
    assert bench.run(bench_args(url, "--no-calibrate", "--trace-out", str(out))) == 0
    capsys.readouterr()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 8  # 4 sessions x 2 turns
    assert [x["timestamp"] for x in lines] == sorted(x["timestamp"] for x in lines)
    first = {x["session"]: x["prompt"] for x in lines if x["turn"] == 0}
    assert len(set(first.values())) == 4
    for x in lines:
        if x["turn"] == 1:  # a later turn extends the earlier prompt, as it was sent
            assert x["prompt"].startswith(first[x["session"]] + "\n")
    rc, rep = _run(capsys, "--model", str(model_dir), "--trace", str(out), *COMMON)
    assert rc == 0 and rep["trace"]["requests"] == 8 and rep["trace"]["bad_lines"] == 0
    assert rep["max_hit_rate"] > 0.3  # the shared prefix and the earlier turns are reused


# ------------------------------------------------------------- hostile input


def test_hostile_lines_are_bad_lines_not_crashes(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """Lines that made the decoder, msgpack or float() raise are counted like any bad line:
    exit 1 means "the plan does not fit", never "the reader crashed"."""
    good = {"prompt_token_ids": list(range(40))}
    lines = [
        good,
        "[" * 100_000 + "]" * 100_000,  # RecursionError in the JSON decoder
        '{"a": ' * 100_000 + "1" + "}" * 100_000,
        {"prompt_token_ids": [2**64, 1, 2]},  # OverflowError in msgpack
        {"prompt_token_ids": [1, 2, 2**63]},
        '{"prompt_token_ids": [1, 2, 3], "timestamp": ' + "9" * 400 + "}",  # float()
        '{"prompt_token_ids": [1, 2, 3], "timestamp": -' + "9" * 400 + "}",
        good,
    ]
    path = _write(tmp_path / "hostile.jsonl", lines)
    rc, out = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON[:-1])
    assert rc == 0
    assert "2 requests" in out and "6 bad lines" in out
    assert "line 2: JSON nested too deeply" in out and "line 3: JSON nested too deeply" in out
    assert "line 4: prompt_token_ids is not a list of integers in [0, 2**63)" in out
    assert "line 6: timestamp is out of range" in out
    rc, rep = _run(capsys, "--model", str(model_dir), "--trace", str(path), *COMMON)
    assert rc == 0 and rep["trace"]["bad_lines"] == 6 and rep["trace"]["requests"] == 2


def test_every_prompt_and_line_is_bounded(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However a line gives its prompt (token ids, a text or chat prompt once tokenized)
    it is at most MAX_INPUT_LENGTH tokens, and a line at most MAX_LINE_BYTES: over either
    it is a bad line counted as over a bound, and the lines after it are read. (The bounds
    are lowered here; tests/sizing/trace/test_trace_hash_ids.py runs the real ones.)"""
    from kvtier.sizing.trace import read as trace_read

    monkeypatch.setattr(trace_read, "MAX_INPUT_LENGTH", 40)
    monkeypatch.setattr(trace_read, "MAX_LINE_BYTES", 2000)
    lines = [
        {"prompt_token_ids": list(range(40))},  # at the bound
        {"prompt_token_ids": list(range(41))},
        {"prompt": " ".join(["fox"] * 40)},  # 41 tokens with the BOS
        {"messages": [{"role": "user", "content": " ".join(["dog"] * 40)}]},
        {"prompt_token_ids": [1, 2, 3], "pad": "x" * 2000},  # a line too long
        {"prompt_token_ids": list(range(30)), "output_length": 41},
        {"prompt": " ".join(["fox"] * 39), "timestamp": 5},
        {"prompt_token_ids": [1, 2, 3], "timestamp": 2},
    ]  # earlier than the line before
    path = _write(tmp_path / "t.jsonl", lines)
    with path.open("ab") as f:
        f.write(b'{"prompt_token_ids": [' + b"1, " * 1000 + b"1]}")  # no newline at the end
    stats = tr.TraceStats()
    reqs = list(tr.read_trace(str(path), tr.Tokenizer(str(model_dir)), stats))
    assert [len(r.token_ids) for r in reqs] == [40, 40, 3]
    assert stats.bad_lines == stats.over_cap == 6
    assert [e.split(":")[0] for e in stats.bad_examples] == [f"line {i}" for i in (2, 3, 4, 5, 6)]
    assert "prompt_token_ids is 41 tokens, over the 40-token bound" in stats.bad_examples[0]
    assert "the prompt as tokenized is 41 tokens" in stats.bad_examples[1]
    assert stats.bad_examples[3] == "line 5: line of more than 2000 bytes skipped"
    assert "output_length is not an integer in [0, 40]" in stats.bad_examples[4]
    assert (stats.min_timestamp, stats.max_timestamp) == (2, 5)
    rep = tr.report(
        tr.Simulation(16, 16, 0),
        stats,
        path=str(path),
        host_slot_bytes=1,
        object_chunk_bytes=1,
        target=0.5,
        host_tier_bytes=None,
        gpu_kv_tokens=0,
        gpu_kv_source="test",
    )
    assert rep["trace"]["duration_s"] == 3 and rep["trace"]["over_cap_lines"] == 6


def test_a_long_line_is_skipped_without_holding_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 24 MB line (no newline anywhere) is read past in pieces, not held: memory is the
    bound's, not the line's."""
    from kvtier.sizing.trace import read as trace_read

    monkeypatch.setattr(trace_read, "MAX_LINE_BYTES", 2**20)
    path = tmp_path / "t.jsonl"
    with path.open("wb") as f:
        f.write(b'{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [')
        for _ in range(24):
            f.write(b"7, " * (2**20 // 3))
    tracemalloc.start()
    try:
        stats = tr.TraceStats()
        reqs = list(tr.read_trace(str(path), None, stats))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(reqs) == 1 and stats.bad_lines == stats.over_cap == 1
    assert peak < 6 * 2**20, f"{peak / 2**20:.0f} MiB traced"


@pytest.mark.parametrize(
    "flags",
    [
        ("--trace-max-chunks", "0"),
        ("--trace-max-chunks", "-3"),
        ("--trace-max-chunks", "1e11"),
        ("--trace-max-chunks", "100000000000"),
        ("--trace-max-chunks", "1.5"),
        ("--trace-max-chunks", "nan"),
    ],
)
def test_bad_max_chunks_is_a_usage_error(
    model_dir: Path, tmp_path: Path, capsys: Any, flags: tuple[str, str]
) -> None:
    path = _write(tmp_path / "t.jsonl", [{"prompt_token_ids": list(range(40))}])
    with pytest.raises(SystemExit) as e:
        main(["size", "--model", str(model_dir), "--trace", str(path), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "--trace-max-chunks" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags", [("--chunk-size", "0"), ("--chunk-size", "-8"), ("--cpu-bytes", "-1")]
)
def test_bad_trace_numbers_exit_2(
    model_dir: Path, tmp_path: Path, capsys: Any, flags: tuple[str, str]
) -> None:
    path = _write(tmp_path / "t.jsonl", [{"prompt_token_ids": list(range(40))}])
    rc = main(
        ["size", "--model", str(model_dir), "--trace", str(path), "--block-size", "4", *flags]
    )
    assert rc == 2  # refused as the connector refuses it, naming the config key
    assert f"kvtier config '{flags[0][2:].replace('-', '_')}'" in capsys.readouterr().err


def test_max_chunks_in_the_scientific_notation_and_memory_follows_the_trace(
    model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    path = _write(tmp_path / "t.jsonl", [{"prompt_token_ids": list(range(40))}] * 2)
    rc, rep = _run(
        capsys,
        "--model",
        str(model_dir),
        "--trace",
        str(path),
        *COMMON,
        "--trace-max-chunks",
        "4e9",
    )
    assert rc == 0 and rep["keys"]["max_chunks"] == 4_000_000_000
    stack = tr.LruStack(2**32)  # no table of 2**33 entries up front
    assert len(stack._tree) <= 4097


def test_lru_stack_grows_with_its_keys() -> None:
    rng = random.Random(4)
    stack = tr.LruStack(limit=10**9)
    order: list[int] = []
    for i in range(12_000):  # past the first table's size: the tree grows while in use
        key = i if rng.random() < 0.6 else rng.randrange(max(1, i))
        if i % 97 == 0:
            for probe in (key, rng.randrange(i + 1)):
                want = len(order) - order.index(probe) if probe in order else None
                assert stack.depth(probe) == want
        stack.access(key)
        if key in order:
            order.remove(key)
        order.append(key)
    assert len(stack) == len(order) and len(stack._tree) > 4097
