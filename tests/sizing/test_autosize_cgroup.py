"""``cpu_bytes: auto`` finds the memory limit of the process's own cgroup, up the hierarchy.

Fake cgroup trees in tmp_path: the limit that OOM-kills a pod is usually on the
pod's cgroup, an ancestor of the container's, never at the mount root the old
code read.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.sizing.autosize import cgroup_available_bytes

GiB = 1024**3
V1_UNLIMITED = 9223372036854771712


def write(level: Path, **files: object) -> None:
    level.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (level / name.replace("_", ".", 1)).write_text(f"{value}\n")


def v2(level: Path, limit: object = None, usage: object = None) -> None:
    files = {}
    if limit is not None:
        files["memory_max"] = limit
    if usage is not None:
        files["memory_current"] = usage
    write(level, **files)


def v1(level: Path, limit: object = None, usage: object = None) -> None:
    files = {}
    if limit is not None:
        files["memory_limit_in_bytes"] = limit
    if usage is not None:
        files["memory_usage_in_bytes"] = usage
    write(level, **files)


def proc(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "proc-self-cgroup"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_v2_limit_on_an_intermediate_level(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v2(root, usage=50 * GiB)  # the root cgroup has no memory.max
    v2(root / "kubepods.slice", "max", 40 * GiB)
    v2(root / "kubepods.slice" / "pod1", 8 * GiB, 3 * GiB)  # the pod's limit
    v2(root / "kubepods.slice" / "pod1" / "ctr", "max", 1 * GiB)
    pc = proc(tmp_path, "0::/kubepods.slice/pod1/ctr")
    assert cgroup_available_bytes(str(root), pc) == 5 * GiB


def test_v2_smallest_headroom_wins(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v2(root / "a", 8 * GiB, 7 * GiB)  # 1 GiB left for the whole slice
    v2(root / "a" / "b", 4 * GiB, 1 * GiB)  # 3 GiB left in the container's own limit
    pc = proc(tmp_path, "0::/a/b")
    assert cgroup_available_bytes(str(root), pc) == 1 * GiB
    v2(root / "a", 16 * GiB, 7 * GiB)
    assert cgroup_available_bytes(str(root), pc) == 3 * GiB


def test_v2_level_without_usage_is_charged_the_usage_below_it(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v2(root / "slice", 6 * GiB)  # memory.current missing or unreadable
    v2(root / "slice" / "ctr", "max", 2 * GiB)
    assert cgroup_available_bytes(str(root), proc(tmp_path, "0::/slice/ctr")) == 4 * GiB


def test_v2_unlimited_everywhere_and_garbage_files(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v2(root / "a", "max", GiB)
    v2(root / "a" / "b", "", "lots")
    v2(root / "a" / "b" / "c", "not-a-number", "1")
    assert cgroup_available_bytes(str(root), proc(tmp_path, "0::/a/b/c")) is None


def test_v2_usage_over_the_limit_leaves_zero(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v2(root / "a", GiB, 2 * GiB)
    assert cgroup_available_bytes(str(root), proc(tmp_path, "0::/a")) == 0


def test_v1_nested_with_unlimited_levels(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    mem = root / "memory"
    v1(mem, V1_UNLIMITED, 60 * GiB)
    v1(mem / "kubepods" / "pod1", 6 * GiB, 2 * GiB)
    v1(mem / "kubepods" / "pod1" / "ctr", V1_UNLIMITED, 1 * GiB)
    pc = proc(
        tmp_path,
        "12:pids:/kubepods/pod1/ctr",
        "4:memory:/kubepods/pod1/ctr",
        "1:name=systemd:/kubepods/pod1/ctr",
        "0::/",
    )
    assert cgroup_available_bytes(str(root), pc) == 4 * GiB


def test_v1_memory_in_a_combined_hierarchy_line(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v1(root / "memory" / "job", 3 * GiB, GiB)
    assert cgroup_available_bytes(str(root), proc(tmp_path, "7:cpu,memory:/job")) == 2 * GiB


def test_v1_unlimited(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v1(root / "memory", V1_UNLIMITED, GiB)
    v1(root / "memory" / "x", V1_UNLIMITED, GiB)
    assert cgroup_available_bytes(str(root), proc(tmp_path, "4:memory:/x")) is None


def test_namespaced_cgroup_uses_the_mount_root(tmp_path: Path) -> None:
    # with a cgroup namespace the container sees "/", and its own cgroup is the mount
    root = tmp_path / "cgroup"
    v2(root, 2 * GiB, GiB)
    assert cgroup_available_bytes(str(root), proc(tmp_path, "0::/")) == GiB
    # a host path that does not exist under the container's mount: fall back to the mount root
    pc = proc(tmp_path, "0::/kubepods.slice/pod1/ctr")
    assert cgroup_available_bytes(str(root), pc) == GiB
    v1(root / "memory", 4 * GiB, GiB)
    assert cgroup_available_bytes(str(root), proc(tmp_path, "4:memory:/docker/abc")) == 3 * GiB


def test_a_path_cannot_leave_the_mount(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v2(root, 2 * GiB, GiB)
    v2(tmp_path, GiB // 2, 0)  # outside the mount: never read
    assert cgroup_available_bytes(str(root), proc(tmp_path, "0::/../..")) == GiB


def test_v1_listed_but_not_mounted_reads_v2(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v2(root / "a", 5 * GiB, GiB)
    pc = proc(tmp_path, "4:memory:/a", "0::/a")
    assert cgroup_available_bytes(str(root), pc) == 4 * GiB


def test_without_proc_cgroup_the_mount_root_is_read(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    missing = str(tmp_path / "no-proc")
    v2(root, 8 * GiB, GiB)
    assert cgroup_available_bytes(str(root), missing) == 7 * GiB
    assert cgroup_available_bytes(str(tmp_path / "nothing"), missing) is None
    v1(tmp_path / "v1" / "memory", 4 * GiB, GiB)
    assert cgroup_available_bytes(str(tmp_path / "v1"), missing) == 3 * GiB


def _real_limits() -> list[int]:
    """The finite memory limits from this process's own cgroup up to the mount, read here
    without kvtier's code (v1 when /proc/self/cgroup lists ``memory``, else v2)."""
    own = dict(
        line.split(":", 2)[1:]
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        if line.count(":") >= 2
    )
    v1 = next((p for c, p in own.items() if "memory" in c.split(",")), None)
    mount, path, name = (
        (Path("/sys/fs/cgroup/memory"), v1, "memory.limit_in_bytes")
        if v1 is not None and Path("/sys/fs/cgroup/memory").is_dir()
        else (Path("/sys/fs/cgroup"), own.get("", "/"), "memory.max")
    )
    here = mount / path.lstrip("/")
    if not here.is_dir():
        here = mount
    limits = []
    while True:
        text = (here / name).read_text().strip() if (here / name).exists() else "max"
        if text.isdigit() and int(text) < 1 << 60:
            limits.append(int(text))
        if here == mount:
            return limits
        here = here.parent


def test_the_real_host_reads_its_own_cgroup() -> None:
    limits = _real_limits()
    got = cgroup_available_bytes()
    if not limits:
        assert got is None  # no level limits this process: nothing to cap
    else:
        assert got is not None and 0 <= got <= min(limits)
