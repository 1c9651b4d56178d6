"""The object tier's URL is read in one place (``kvtier/config/urls.py``) into a
:class:`~kvtier.config.RemoteURL` the config carries; the tiers, the engine and the store
command ask that value, never the string.

Two URL readings drift apart: "is this a directory?" was answered by
``startswith("file:")`` in three modules while ``open_tier`` went by urlparse's
lower-cased scheme, so ``FILE:///kv`` opened a directory tier that the scheduler and the
one-step lookup did not treat as one. The scans below keep a second reading from coming
back; the unit tests pin what the one reading gives.
"""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

from kvtier.config import KEYS, RemoteURL, load_config, parse_remote
from kvtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
#: the one module that reads URLs
PARSER = ROOT / "kvtier" / "config" / "urls.py"
#: urllib.parse's readers and writers of URL structure (unquote of a file name is not one)
URL_FUNCS = {"urlparse", "urlsplit", "urlunparse", "urlunsplit", "parse_qs", "parse_qsl"}


def _sources() -> list[Path]:
    files = sorted((ROOT / "kvtier").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    return [p for p in files if p != PARSER]


def url_readers(tree: ast.AST) -> list[str]:
    """Where ``tree`` imports or calls one of :data:`URL_FUNCS` (``urlparse(...)``,
    ``urllib.parse.urlsplit(...)``, ``from urllib.parse import urlparse``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "urllib.parse":
            found += [f"import {a.name}" for a in node.names if a.name in URL_FUNCS]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
            if name in URL_FUNCS:
                found.append(f"{name}() at line {node.lineno}")
    return found


def file_prefix_checks(tree: ast.AST) -> list[str]:
    """Where ``tree`` asks ``x.startswith("file:...")`` (a tuple holding one too)."""
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "removeprefix")
            and node.args
        ):
            continue
        arg = node.args[0]
        consts = arg.elts if isinstance(arg, ast.Tuple) else [arg]
        if any(
            isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.startswith("file:")
            for c in consts
        ):
            found.append(f"line {node.lineno}")
    return found


def test_the_scans_see_what_they_look_for() -> None:
    """Each scan fails on the forms the old code used, so a pass means something."""
    old = ast.parse(
        "from urllib.parse import unquote, urlparse\n"
        "import urllib.parse\n"
        "a = urlparse(u).scheme\n"
        "b = urllib.parse.urlsplit(u)\n"
        "c = unquote(name)\n"
        'd = (cfg.remote_url or "").startswith("file:")\n'
        'e = url.startswith(("s3://", "file://"))\n'
    )
    assert sorted(url_readers(old)) == [
        "import urlparse",
        "urlparse() at line 3",
        "urlsplit() at line 4",
    ]
    assert sorted(file_prefix_checks(old)) == ["line 6", "line 7"]
    assert url_readers(ast.parse(PARSER.read_text())), "the parser itself reads URLs"


def test_only_the_parser_reads_urls() -> None:
    """kvtier/ and bench/: no module but config/urls.py reads a URL's structure."""
    found = {}
    for path in _sources():
        hits = url_readers(ast.parse(path.read_text(), str(path)))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, f"URLs read outside kvtier/config/urls.py (use cfg.remote): {found}"


def test_no_file_prefix_checks() -> None:
    """\"Is the tier a directory?" is ``RemoteURL.is_local``, nowhere a string prefix."""
    found = {}
    for path in [PARSER, *_sources()]:
        text = path.read_text()
        hits = file_prefix_checks(ast.parse(text, str(path)))
        if 'startswith("file:' in text or "startswith('file:" in text:
            hits.append('the text startswith("file:')
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, f"file: prefix checks (use cfg.remote.is_local): {found}"


@pytest.mark.parametrize(
    ("url", "kind", "where"),
    [
        ("file:///var/kv%20cache", "file", {"directory": "/var/kv cache"}),
        ("file://localhost/kv", "file", {"directory": "/kv"}),
        ("FILE:///kv", "file", {"directory": "/kv"}),
        ("s3://bucket", "s3", {"bucket": "bucket", "prefix": ""}),
        ("s3://bucket/a/b/", "s3", {"bucket": "bucket", "prefix": "a/b/"}),
        ("redis://h:6379/0", "redis", {"seeds": ()}),
        ("rediss://h/3", "redis", {"seeds": ()}),
        (
            "rediss+cluster://u:pw@[::1]:7000,h2/?ssl_ca_certs=/ca.pem",
            "redis-cluster",
            {
                "seeds": (("::1", 7000), ("h2", 6379)),
                "node_url": "rediss://u:pw@[::1]:7000/0?ssl_ca_certs=/ca.pem",
                "seed_url": "rediss://[::1]:7000",
            },
        ),
    ],
)
def test_what_the_url_reads_as(url: str, kind: str, where: dict[str, object]) -> None:
    remote = RemoteURL.parse(url)
    assert remote.kind == kind and remote.text == url
    assert remote.is_local == (kind == "file")
    for name, value in where.items():
        assert getattr(remote, name) == value, name


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2-pw@h:6379/0",
        "redis://user:hunter2-pw@h:6379/0",
        "rediss://h:6379/0?password=hunter2-pw",
        "redis+cluster://:hunter2-pw@h1:7000,h2:7001/",
    ],
)
def test_the_password_never_shows(url: str) -> None:
    """repr, str, the config's repr and redacted(), an error naming the URL: no password."""
    remote = RemoteURL.parse(url)
    cfg = load_config({"remote_url": url}, environ={})
    assert cfg.remote == remote
    shown = [repr(remote), str(remote), remote.safe, repr(cfg), str(cfg.redacted()), repr([remote])]
    for text in shown:
        assert "hunter2" not in text, text
    assert "hunter2" in remote.text  # the client still gets it


def test_the_config_carries_the_parsed_url() -> None:
    cfg = load_config({"remote_url": " redis://h:6379/0 "}, environ={})
    assert cfg.remote is not None and cfg.remote.text == cfg.remote_url == "redis://h:6379/0"
    assert "remote" not in KEYS and set(cfg.redacted()) == set(KEYS)
    assert load_config({}, environ={}).remote is None
    # a config replaced or unpickled keeps its URL and its reading in step
    moved = dataclasses.replace(cfg, remote_url="file:///kv")
    assert moved.remote is not None and moved.remote.directory == "/kv"
    assert dataclasses.replace(cfg, remote_url=None).remote is None
    assert pickle.loads(pickle.dumps(cfg)).remote == cfg.remote
    assert parse_remote("remote_url", "") is None


def test_one_answer_to_is_it_a_directory() -> None:
    """``FILE:///kv`` opens a directory tier (urlparse lower-cases the scheme), so every
    question about it gets the same answer: file_max_bytes is accepted, and the engine
    treats it as a directory (it used to ask ``startswith("file:")``, which said no)."""
    cfg = load_config({"remote_url": "FILE:///kv", "file_max_bytes": "1GiB"}, environ={})
    assert cfg.remote is not None and cfg.remote.is_local and cfg.remote.directory == "/kv"
    with pytest.raises(ConfigError, match="only with a file:// remote_url"):
        load_config({"remote_url": "s3://b/kv", "file_max_bytes": "1GiB"}, environ={})


def test_a_tier_takes_the_value_or_a_string() -> None:
    """The backends take the config's RemoteURL as it is; a string (tests, benchmarks)
    goes through the same parser, with the config's error for a bad one."""
    from kvtier.objects.tiers.s3 import S3Tier

    tier = S3Tier(RemoteURL.parse("s3://bucket/a/b"), endpoint_url="http://127.0.0.1:9")
    assert (tier.bucket, tier.prefix) == ("bucket", "a/b/")
    assert repr(tier) == "S3Tier('s3://bucket/a/b/')"
    with pytest.raises(ValueError, match="S3Tier needs"):
        S3Tier("redis://h/0")
    with pytest.raises(ConfigError, match="s3:// needs a bucket name"):
        S3Tier("s3://bad bucket/x")
