"""What many tests need, in one place: loopback ports, the chunks a directory tier
holds, a chunk's worth of patterned bytes and the results of a RemoteIO's ops. (The
connector config every test and bench builds comes from the product itself:
kvtier.sizing.emit.connector_config.)"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import msgpack
import pytest
import xxhash

from kvtier.config import load_config
from kvtier.objects import codec
from kvtier.objects.codec import _canonical
from kvtier.objects.sealing import Signer
from kvtier.objects.tiers import ObjectTier, open_tier
from kvtier.ops import OpResult

#: the bytes of one [2, 8, 64] bfloat16 chunk, what the RemoteIO tests move
PAYLOAD_SIZE = 2 * 8 * 64 * 2


class Polled(Protocol):
    def poll(self) -> list[OpResult]: ...


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chunk_files(root: Path) -> list[Path]:
    """The chunk objects a file:// tier holds: its own bookkeeping (the sweep lock, temp
    files of writes in flight) is dot-named, and a generation's manifest
    (``gen-<id>/manifest``, quoted into one file name) is not a chunk."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith("%2Fmanifest")
    )


def xxh3_framed(
    key: str, payload: bytes, *, dtype: str, shape: list[int], signer: Signer | None = None
) -> list[bytes]:
    """A chunk as kvtier framed it before CRC-32 (an ``xxh`` field: its xxh3-128), signed
    with ``signer``'s HMAC key when given: its head and its payload."""
    digest = xxhash.xxh3_128_digest(payload)
    header = {
        "v": codec.FORMAT_VERSION,
        "key": key,
        "dtype": dtype,
        "shape": shape,
        "len": len(payload),
        "xxh": digest,
    }
    if signer is not None:
        canon = _canonical(codec.FORMAT_VERSION, key, dtype, shape, len(payload), digest)
        header["sig"] = signer.sign(canon, memoryview(payload))
    packed = msgpack.packb(header, use_bin_type=True)
    return [codec.MAGIC + struct.pack("<I", len(packed)) + packed, payload]


def payload(seed: int = 1, size: int = PAYLOAD_SIZE) -> memoryview:
    """``size`` bytes that differ from ``seed`` to seed (a chunk's stand-in)."""
    return memoryview(bytearray((seed * 31 + i) % 251 for i in range(size)))


def collect(rio: Polled, n: int, timeout: float = 10.0) -> dict[int, OpResult]:
    """Poll until ``n`` results came (at most ``timeout`` s): op id -> result, each op
    reported once."""
    out: list[OpResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += rio.poll()
        time.sleep(0.002)
    assert len(out) == n, f"expected {n} results, got {out}"
    assert len({r.op_id for r in out}) == n, f"an op reported twice: {out}"
    return {r.op_id: r for r in out}


def open_loopback_tier(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> ObjectTier:
    """The object tier of ``kind`` (``file``, ``s3``, ``redis``) on this session's loopback
    services (conftest's ``s3_bucket``, ``redis_url``), opened from its config as an engine
    opens it."""
    if kind == "file":
        url = f"file://{tmp_path}/objects"
    elif kind == "s3":
        url = request.getfixturevalue("s3_bucket").url  # its endpoint from the AWS_* env
    else:
        url = request.getfixturevalue("redis_url")
    tier = open_tier(load_config({"remote_url": url}, environ={}))
    assert tier.name == kind
    return tier


def kv_like(n_values: int, seed: int = 0) -> bytes:
    """``n_values`` bf16 values shaped like K/V (roughly normal, a few channels much larger):
    bytes that compress as KV does (its exponent byte plane)."""
    import torch  # only the tests that compress need it

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_values // 64, 64, generator=g) * (torch.rand(64, generator=g) * 3 + 0.1)
    return x.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def snapshot(out: list[bytes], view: memoryview) -> None:
    """Append ``view``'s bytes as they are now (a read's ``found``: the slot before its
    payload lands)."""
    out.append(bytes(view))


def before_reads(
    monkeypatch: pytest.MonkeyPatch,
    target: type[ObjectTier] | ObjectTier,
    before: Callable[[str], None],
) -> None:
    """Call ``before(key)`` ahead of every object read of ``target`` (a tier class or one
    tier): ``read_into``, and ``read_into_hashed`` where the backend reads that way itself
    (the base one reads through ``read_into``, so it is not wrapped twice)."""
    cls = target if isinstance(target, type) else type(target)
    names = ["read_into"]
    if cls.read_into_hashed is not ObjectTier.read_into_hashed:
        names.append("read_into_hashed")
    for name in names:
        real = getattr(target, name)
        if isinstance(target, type):

            def wrapped(self: ObjectTier, key: str, *a: Any, _real: Any = real, **kw: Any) -> Any:
                before(key)
                return _real(self, key, *a, **kw)
        else:

            def wrapped(key: str, *a: Any, _real: Any = real, **kw: Any) -> Any:  # type: ignore[misc]
                before(key)
                return _real(key, *a, **kw)

        monkeypatch.setattr(target, name, wrapped)


def directory_usage(root: str | os.PathLike[str]) -> dict[str, int]:
    """Every regular file under ``root`` (objects, temp files of writes in flight,
    manifests, the lock file): what the disk holds, not what the sweep chose to count.

    Never more than the directory held at the walk's end: a walk is no snapshot (an
    object evicted after the walk counted it and one written where the walk had not
    looked yet would both count), so only the files still there, the same inode, at the
    end are counted, each inode once (a temp file renamed to its object's name while the
    directory is listed may be listed under both names)."""
    found: dict[int, list[str]] = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # evicted while we walk
            found.setdefault(st.st_ino, []).append(path)
    total = files = 0
    for ino, paths in found.items():
        for path in paths:  # under any name it was listed under (a renamed temp file)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_ino == ino:
                files += 1
                total += st.st_size
                break
    return {"files": files, "bytes": total}
