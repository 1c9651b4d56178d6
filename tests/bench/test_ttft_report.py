"""``bench/ttft.py`` without an engine: its flags, the tables and the plot it makes of a
result, the prompts it sends, and its object tiers (servers, copies, the raw client)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

_ENV = dict(os.environ)
import llm_engine  # noqa: E402
import restart_tiers  # noqa: E402
import ttft  # noqa: E402  (sets vLLM's variables for its engines: not for other tests')

for _name in set(os.environ) - set(_ENV):
    del os.environ[_name]

BASE = {
    2048: {
        "cold_ttft_s": 0.6923,
        "engine_hit_ttft_s": 0.1109,
        "kvtier_hit_ttft_s": 0.0388,
        "cached_tokens_engine": 2016,
        "cached_tokens_kvtier": 2016,
    }
}
RAW = {
    "objects": 8,
    "bytes": 32 * 2**20,
    "threads": 2,
    "parallel_s": 0.0025,
    "first_then_rest_s": 0.0028,
}
RESTARTS = {
    "file": {
        "2048": {
            "restart_hit_ttft_s": 0.0534,
            "engine_hit_ttft_s": 0.0303,
            "cached": [2016, 2016, 2016],
            "raw": RAW,
        }
    },
    "redis": {
        "2048": {
            "restart_hit_ttft_s": 0.0672,
            "engine_hit_ttft_s": 0.0325,
            "cached": [2016, 2016, 2016],
            "raw": {**RAW, "parallel_s": 0.018, "first_then_rest_s": 0.017},
        }
    },
}
BREAKDOWN = """
restart hit = in-engine hit + raw client (same chunks, same threads) + kvtier's own (ms)
tokens  tier  restart  in-eng     raw raw 1st+     own own goal ÷in-eng  goal chunks   MiB
  2048  file     53.4    30.3     2.5      2.8    20.6     10.0    1.76   1.2      8    32
  2048 redis     67.2    32.5    18.0     17.0    16.7     10.0    2.07   1.4      8    32
"""


@pytest.fixture(autouse=True)
def _omp_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ttft.py sets for its engines, and its result records."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")


def report(argv: list[str], restarts: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ttft._report(ttft.parse_args(argv), BASE, restarts)
    return out.getvalue()


def test_the_sweep_table_and_its_breakdown() -> None:
    text = report(["--sweep", "2048", "--restart", "file,redis", "--samples", "3"], RESTARTS)
    assert (
        text
        == """
TTFT (ms), median of 3 per length, 8 layers x 1024
tokens     cold in-engine    host   file restart ÷ in-eng  redis restart ÷ in-eng
  2048    692.3     110.9    38.8           53.4     1.76           67.2     2.07
"""
        + BREAKDOWN
    )


def test_the_restarted_engines_first_request_is_reported() -> None:
    """(a restart hit arriving right after startup: what the engine's startup left to it)"""
    first = {"tokens": 2048, "ttft_s": 0.0696, "cached": 2016}
    restarts = {
        kind: {"2048": {**v["2048"], "first_request": first}} for kind, v in RESTARTS.items()
    }
    text = report(["--sweep", "2048", "--restart", "file,redis", "--samples", "3"], restarts)
    assert text.endswith(
        BREAKDOWN
        + """
the restarted engine's first request (a restart hit right after startup), ms:
  2048  file     69.6   (2016 tokens cached)
  2048 redis     69.6   (2016 tokens cached)
"""
    )


def test_the_in_process_engine_beside_the_multiprocess_one() -> None:
    """(--profile measures the same hits in an in-process engine too: both are shown)"""
    inproc = {"restart_hit_ttft_s": 0.0455, "engine_hit_ttft_s": 0.0287}
    restarts = {
        "file": {"2048": {**RESTARTS["file"]["2048"], "inprocess": inproc}},
        "redis": RESTARTS["redis"],
    }
    text = report(["--sweep", "2048", "--restart", "file,redis", "--samples", "3"], restarts)
    assert text.endswith(
        BREAKDOWN
        + """
the same hits, in-process engine (--profile) beside the multiprocess one (vllm serve's), ms:
tokens  tier  in-proc  in-eng     ÷    multi  in-eng     ÷
  2048  file     45.5    28.7  1.59     53.4    30.3  1.76
"""
    )


def test_one_length_with_its_goals() -> None:
    text = report(["--restart", "file,redis", "--samples", "3"], RESTARTS)
    assert (
        text
        == """
TTFT, median of 3, 2048-token prompt, 8 layers x 1024
  (a) cold prefill                     692.3 ms
  (b) vLLM in-engine prefix hit        110.9 ms   (2016 tokens cached)
  (c) kvtier host-tier hit              38.8 ms   (2016 tokens loaded)
  c/b = 0.350   (goal <= 1.10)
  c/a = 0.056   (goal <= 0.06)
  (d) file  tier hit after an engine restart     53.4 ms; ÷ in-engine hit there (30.3 ms) = 1.76   (goal <= 1.2; 2016 tokens cached)
  (d) redis tier hit after an engine restart     67.2 ms; ÷ in-engine hit there (32.5 ms) = 2.07   (goal <= 1.4; 2016 tokens cached)
"""  # noqa: E501
        + BREAKDOWN
    )


def test_the_json_result_and_the_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "sweep.png"
    text = report(
        [
            "--sweep",
            "2048",
            "--restart",
            "file,redis",
            "--json",
            "--out",
            str(out),
            "--plot",
            str(png),
        ],
        RESTARTS,
    )
    assert json.loads(text) == json.loads(out.read_text())
    row = json.loads(text)["sweep"][0]
    assert row["restart"]["redis"]["kvtier_own_s"] == pytest.approx(0.0672 - 0.0325 - 0.018)
    assert row["kvtier_over_engine_hit"] == pytest.approx(0.0388 / 0.1109)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--plot", "x.png"], "--plot needs --sweep"),
        (["--restart", "file,gcs"], "--restart takes file, s3, redis; not gcs"),
        (["--sweep", "32"], "expected integers >= 64"),
    ],
)
def test_bad_flags_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        ttft.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_sweep_measures_every_tier_by_default() -> None:
    args = ttft.parse_args(["--sweep", "512,1024"])
    assert args.restart == "file,s3,redis" and args.lengths == [512, 1024]


def test_the_prompts_share_nothing() -> None:
    seeds = llm_engine.seeds(0, 40)
    firsts = {llm_engine.prompt(s, 1)[0] for s in seeds}
    assert len(firsts) == 40 and llm_engine.prompt(999, 1)[0] not in firsts
    assert llm_engine.prompt(1, 64) == llm_engine.prompt(6, 64)  # why seeds skips some


def test_objects_copied_into_redis_read_back_by_the_raw_client(tmp_path: Path) -> None:
    """A file tier's objects (temp and hashed names skipped) copied into a Redis tier
    started for the test; the raw client reads as many as a prompt of each length loads."""
    root = tmp_path / "written"
    (root / "ab").mkdir(parents=True)
    for i in range(3):
        (root / "ab" / f"kv%2Fchunk-{i}").write_bytes(bytes([i]) * 4096)
    (root / "ab" / ".tmp-1").write_bytes(b"x")
    (root / "ab" / "h-123").write_bytes(b"x")
    file_extra = {"remote_url": f"file://{root}"}
    raw = restart_tiers.raw_client("file", file_extra, [300, 600], threads=2, reps=2)
    assert [raw[n]["objects"] for n in ("300", "600")] == [2, 3]
    assert raw["600"]["bytes"] == 3 * 4096 and raw["600"]["parallel_s"] > 0
    with restart_tiers.object_tier("redis", str(tmp_path / "srv")) as (extra, env):
        assert env == {} and extra["remote_url"].startswith("redis://127.0.0.1:")
        assert restart_tiers.copy_objects(str(root), "redis", extra) == 3
        import redis

        client = redis.Redis.from_url(extra["remote_url"])
        assert client.get("kv/chunk-2") == bytes([2]) * 4096
        raw = restart_tiers.raw_client("redis", extra, [600], threads=2, reps=1)
        assert raw["600"]["objects"] == 3 and raw["600"]["bytes"] == 3 * 4096
    assert not os.path.exists(tmp_path / "srv" / "tier")


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (libc mmap + mincore; nothing is read)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def test_a_file_tiers_page_cache_is_set_before_it_is_timed() -> None:
    """kvtier's restart hits and the raw client find the file tier in the same state."""
    import tempfile

    # in the checkout, not in a tmpfs /tmp: a tmpfs keeps its pages whatever one advises
    with tempfile.TemporaryDirectory(dir=ROOT) as where:
        root = Path(where) / "tier"
        (root / "ab").mkdir(parents=True)
        data = os.urandom(1 << 20)
        for i in range(3):
            (root / "ab" / f"chunk-{i}").write_bytes(data)
        (root / "ab" / "link").symlink_to(root / "ab" / "chunk-1")  # not followed
        os.sync()  # (dirty pages are not dropped)
        chunk = root / "ab" / "chunk-0"
        extra = {"remote_url": f"file://{root}"}
        assert restart_tiers.set_file_cache(extra, "warm") == 3
        cached = _resident_pages(chunk)
        assert cached == (1 << 20) // 4096
        assert restart_tiers.set_file_cache(extra, "cold") == 3
        assert _resident_pages(chunk) < cached
        assert chunk.read_bytes() == data
        assert restart_tiers.set_file_cache(extra, "warm") == 3
        assert _resident_pages(chunk) == cached
        # a raw-client read sets its own chunks only
        other = root / "ab" / "chunk-1"
        assert restart_tiers.set_page_cache([str(chunk)], "cold") == 1
        assert _resident_pages(chunk) < cached and _resident_pages(other) == cached
    assert restart_tiers.set_file_cache({"remote_url": "redis://127.0.0.1:1"}, "cold") == 0
    with pytest.raises(ValueError, match="warm or cold"):
        restart_tiers.set_file_cache(extra, "hot")


def test_a_file_tier_needs_no_server(tmp_path: Path) -> None:
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / "old").write_bytes(b"left over")
    with restart_tiers.object_tier("file", str(tmp_path)) as (extra, env):
        assert extra == {"remote_url": f"file://{tmp_path}/tier"} and env == {}
    assert not (tmp_path / "tier").exists()  # a fresh directory for every run
