"""The file tier never reads, writes or deletes outside its root, and never hands its files
to a group the process is not in.

Anyone who can write the shared directory can plant ``ab -> /elsewhere`` at the 256
fan-out names. ``O_NOFOLLOW`` on the object's own name protects only the last path
component: through such links writes landed outside the root (``/dev/shm`` too), the
sweep, which skips symlinked directories, counted none of it, and ``file_max_bytes``
was bypassed. These tests plant real symlinks in temporary directories.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest
from kit import payload

from kvtier.errors import ObjectError
from kvtier.objects import codec
from kvtier.objects.health import ConstantBackoff
from kvtier.objects.remote import RemoteIO
from kvtier.objects.tiers.file import FileTier

SHAPE = [2, 8, 64]
SIZE = 2 * 8 * 64 * 2
DT = "bfloat16"


def chunk(key: str, seed: int = 1) -> list[bytes | memoryview]:
    return list(codec.encode(key, payload(seed), dtype=DT, shape=SHAPE))


def link_every_fanout(root: Path, outside: Path) -> None:
    """``root/00 .. root/ff`` all symlinks to ``outside`` (what an attacker plants)."""
    root.mkdir(exist_ok=True)
    outside.mkdir(exist_ok=True)
    for i in range(256):
        os.symlink(outside, root / f"{i:02x}")


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if not p.is_dir()]


def test_writes_through_symlinked_fanout_dirs_are_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "kv", tmp_path / "elsewhere"
    link_every_fanout(root, outside)
    tier = FileTier(str(root), max_bytes=10 * SIZE, background_sweep=False)
    for i in range(64):
        with pytest.raises(ObjectError, match="not a directory"):
            tier.put(f"k{i}", chunk(f"k{i}"))
    assert files_under(outside) == [], "a write landed outside the root"
    # through RemoteIO: counted per-object misses, the tier stays up
    rio = RemoteIO(
        tier, threads=1, queue_depth=64, timeout_s=5.0, signer=None, backoff=ConstantBackoff(30)
    )
    for i in range(16):
        assert rio.submit_put(i, f"r{i}", payload(), dtype=DT, shape=SHAPE)
    results: list = []
    deadline = time.monotonic() + 10
    while len(results) < 16 and time.monotonic() < deadline:
        results += rio.poll()
        time.sleep(0.002)
    assert [r.error_kind for r in results] == ["object"] * 16
    assert not rio.is_down
    rio.close()
    assert files_under(outside) == []
    stats = tier.sweep()
    assert stats.foreign == 256 and stats.total_bytes == 0 and stats.evicted == 0


def test_reads_and_deletes_never_go_through_a_symlinked_fanout_dir(tmp_path: Path) -> None:
    root, outside = tmp_path / "kv", tmp_path / "elsewhere"
    honest = FileTier(str(tmp_path / "staging"), background_sweep=False)
    honest.put("victim", chunk("victim"))
    sub, name = Path(honest.path("victim")).parts[-2:]
    # a valid chunk outside the root, under the name the key would have, and a link to it
    outside.mkdir()
    (outside / name).write_bytes(Path(honest.path("victim")).read_bytes())
    root.mkdir()
    os.symlink(outside, root / sub)
    tier = FileTier(str(root), background_sweep=False)
    with pytest.raises(ObjectError, match="not a directory"):
        tier.get("victim")
    with pytest.raises(ObjectError, match="not a directory"):
        tier.read_into("victim", memoryview(bytearray(SIZE)), 4096)
    assert tier.exists(["victim"]) == [False]
    with pytest.raises(ObjectError):
        tier.delete(["victim"])
    assert (outside / name).exists(), "a delete went through the symlink"


def test_a_fanout_dir_swapped_for_a_symlink_mid_write_is_not_followed(tmp_path: Path) -> None:
    """The forced interleaving a path check (lstat, realpath) would lose: between opening
    the fan-out directory and creating the file in it, the directory is renamed away and
    a symlink put in its place. The write goes where the directory fd points."""
    root, outside = tmp_path / "kv", tmp_path / "elsewhere"
    outside.mkdir()

    class Swapped(FileTier):
        def _create_temp(self, dir_fd: int) -> tuple[int, str]:
            sub = Path(self.path("k")).parent
            os.rename(sub, root / "moved")
            os.symlink(outside, sub)
            return super()._create_temp(dir_fd)

    tier = Swapped(str(root), background_sweep=False)
    Path(tier.path("k")).parent.mkdir()  # the fan-out directory exists, as it mostly does
    tier.put("k", chunk("k"))
    assert files_under(outside) == []
    assert [p.name for p in files_under(root / "moved")] == [Path(tier.path("k")).name]


def test_a_file_planted_at_a_fanout_name_is_one_miss(tmp_path: Path) -> None:
    tier = FileTier(str(tmp_path), background_sweep=False)
    sub = Path(tier.path("k")).parent
    sub.write_bytes(b"not a directory")
    with pytest.raises(ObjectError, match="not a directory"):
        tier.put("k", chunk("k"))
    with pytest.raises(ObjectError, match="not a directory"):
        tier.get("k")
    assert tier.sweep().foreign == 1


def test_the_sweep_counts_and_evicts_only_what_is_under_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "kv", tmp_path / "elsewhere"
    tier = FileTier(str(root), max_bytes=0, background_sweep=False)
    keys = [f"k{i}" for i in range(20)]
    for k in keys:
        tier.put(k, chunk(k))
    outside.mkdir()
    (outside / "precious").write_bytes(b"x" * 1000)
    free = next(f"{i:02x}" for i in range(256) if not (root / f"{i:02x}").exists())
    os.symlink(outside, root / free)
    stats = tier.sweep()
    assert stats.foreign == 1
    assert stats.evicted == len(keys)
    assert (outside / "precious").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of a foreign group needs root")
def test_a_setgid_directory_of_a_foreign_group_does_not_get_the_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    foreign = 54321
    assert foreign not in {os.getegid(), *os.getgroups()}
    root = tmp_path / "kv"
    root.mkdir()
    os.chown(root, -1, foreign)
    os.chmod(root, 0o2770)  # setgid: new entries take the directory's group
    caplog.set_level(logging.WARNING, logger="kvtier")
    tier = FileTier(str(root), background_sweep=False)
    assert "setgid to group 54321" in caplog.text
    tier.put("k", chunk("k"))
    st = os.stat(tier.path("k"))
    assert st.st_gid == os.getegid(), f"the file went to group {st.st_gid}"
    assert os.stat(Path(tier.path("k")).parent).st_gid == os.getegid()
    # a fan-out directory someone else made setgid to a foreign group: same
    sub = Path(tier.path("j")).parent
    if not sub.exists():
        sub.mkdir()
    os.chown(sub, -1, foreign)
    os.chmod(sub, 0o2770)
    tier.put("j", chunk("j"))
    assert os.stat(tier.path("j")).st_gid == os.getegid()
    assert stat.S_IMODE(os.stat(tier.path("j")).st_mode) & 0o007 == 0
    assert bytes(codec.decode(tier.get("j"), key="j", dtype=DT, shape=SHAPE)) == bytes(payload())


def test_a_setgid_directory_of_our_own_group_still_shares_through_it(tmp_path: Path) -> None:
    """The documented way engines of different users share a directory keeps working."""
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, 0o2770)
    tier = FileTier(str(root), background_sweep=False)
    tier.put("k", chunk("k"))
    assert os.stat(tier.path("k")).st_gid == os.stat(root).st_gid
