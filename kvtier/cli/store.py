"""``kvtier store usage | gc | verify``: the shared tier by generation.

The tier is opened as an engine opens it: the URL, and ``--config`` with the engines'
``kv_connector_extra_config`` JSON (endpoint, keys, TLS); ``KVTIER_*`` variables apply
as they do to an engine, except ``KVTIER_REMOTE_URL`` when a URL is given (it wins). Without
a URL the tier is the engines' own (``KVTIER_REMOTE_URL``, else ``--config``'s
``remote_url``): the chart's CronJob runs it so, with the engines' environment. Every
bad input (a flag's value, a config, the tier's credentials, a signed tier without its
key) is one line on stderr and exit status 2, before anything is deleted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import Any

STORE_HELP = "Show, clean and check what the shared object tier holds, per generation"

STORE_EPILOG = """\
Every object key names its generation (gen-<id>/...): one per model identity and
settings (weights, dtypes, layout, namespace, TP/PP size). Engines keep a manifest per
generation (model, namespace, first and last seen) fresh every 60 s; chunks without a
readable manifest are the generation "unknown".

"Recently used" per backend: directory: the file's mtime (a hit refreshes it, at most
once a minute); S3: LastModified, the last write (S3 records no reads); Redis: OBJECT
IDLETIME (reads count)."""

_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)", re.ASCII)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds of ``7d``, ``12h``, ``30m``, ``45s``, ``2w`` or a plain number of seconds."""
    m = _DURATION_RE.fullmatch(text.strip().lower())
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a number with s, m, h, d or w (7d, 12h, 30m)"
        )
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not math.isfinite(seconds):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite duration")
    return seconds


def _size(text: str) -> int:
    from kvtier.config.values import SIZE_HELP, parse_size
    from kvtier.errors import ConfigError

    try:
        return parse_size("--max-bytes", text)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: {SIZE_HELP}") from None


def read_tenant_quotas(path: str) -> dict[str, int]:
    """``--tenant-quotas FILE``: a JSON or YAML object of tenant name (``"*"``: every other
    tenant) -> size, the ``tenant_quotas`` config key's syntax and parser."""
    import yaml

    from kvtier.config.tenants import parse_tenant_quotas
    from kvtier.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise _Refused(f"--tenant-quotas {path}: {exc.strerror}") from None
    try:
        loaded = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise _Refused(f"--tenant-quotas {path}: not JSON or YAML ({exc})") from None
    if not isinstance(loaded, dict) or not loaded:
        raise _Refused(
            f'--tenant-quotas {path}: not an object of tenant name or "*" -> '
            'size, like {"team-a": "8GiB", "*": "2GiB"}'
        )
    try:
        return dict(parse_tenant_quotas("--tenant-quotas", loaded))
    except ConfigError as exc:
        raise _Refused(f"{path}: {exc}") from None


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], help_text: str) -> None:
    """``kvtier store`` and its three commands under the ``kvtier`` command's subparsers."""
    store = sub.add_parser(
        "store",
        help=help_text,
        description=help_text + ".",
        epilog=STORE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmds = store.add_subparsers(dest="store_command", metavar="COMMAND", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "url",
            metavar="URL",
            nargs="?",
            help="the tier, as remote_url: file:///dir, s3://bucket/prefix, "
            "redis://host:port/db, redis+cluster://host:port/; omitted: the "
            "engines' own (KVTIER_REMOTE_URL, else --config's remote_url)",
        )
        p.add_argument(
            "--config",
            metavar="FILE",
            help="JSON file of the engines' "
            "kv_connector_extra_config (or a whole --kv-transfer-config): "
            "s3_endpoint_url, hmac/encryption key variables, TLS settings",
        )
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    u = cmds.add_parser(
        "usage",
        help="bytes and chunks per generation, and the totals",
        description="Per generation: model, namespace, bytes as stored (what "
        "the backend bills), chunks, first and last seen; then the totals.",
    )
    common(u)
    u.add_argument(
        "--by",
        choices=["tenant"],
        help="tenant: bytes and chunks per tenant "
        "per generation, as its manifest attributes them (the tenant whose "
        "request uploaded each chunk; 'unattributed': in no list of it)",
    )
    u.set_defaults(func=_usage)

    g = cmds.add_parser(
        "gc",
        help="delete dead generations, then LRU chunks over a budget",
        description="First delete every chunk and the manifest of generations "
        "not seen for --dead-after; then, with --max-bytes, the least recently "
        "used chunks of the rest until the total is at most SIZE. Safe beside "
        "running engines (a deleted chunk is a counted miss) and beside another "
        "gc.",
        epilog=STORE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(g)
    g.add_argument(
        "--max-bytes",
        metavar="SIZE",
        type=_size,
        help="byte budget after gc: 500GiB, 2TB, or a byte count",
    )
    g.add_argument(
        "--dead-after",
        metavar="DURATION",
        type=parse_duration,
        default=parse_duration("7d"),
        help="a generation whose manifest was last refreshed longer ago is dead "
        "(a chunk without one: its own last use); 7d, 12h, 30m (default 7d)",
    )
    g.add_argument(
        "--tenant-quotas",
        metavar="FILE",
        help="JSON or YAML of tenant name "
        '("*": every other tenant) -> size, as the tenant_quotas setting: '
        '{"team-a": "8GiB", "*": "2GiB"}. A tenant holding more (its '
        "chunks in every generation, as the manifests attribute them) loses its "
        "own least recently used chunks, never another tenant's; after "
        "--dead-after, before --max-bytes",
    )
    g.add_argument(
        "--dry-run", action="store_true", help="print what would be deleted; delete nothing"
    )
    g.set_defaults(func=_gc)

    v = cmds.add_parser(
        "verify",
        help="read chunks and check them with the configured keys",
        description="Read chunks (all, or --sample N at random) and check each "
        "as an engine would: frame, checksum, signature, decryption, its key, "
        "its layout; report the bad ones by kind.",
    )
    common(v)
    v.add_argument("--sample", metavar="N", type=_count, help="check N chunks at random")
    v.add_argument(
        "--delete-bad",
        action="store_true",
        help="delete the chunks that are corrupt (checksum, truncated, malformed, "
        "wrong_key); manifests and objects failing for a key reason (signature, "
        "sealed) are kept, and nothing is deleted when more than half of those "
        "checked fail for a key reason. Run it with --dry-run first",
    )
    v.add_argument(
        "--dry-run",
        action="store_true",
        help="with --delete-bad: print what it would delete; delete nothing",
    )
    v.set_defaults(func=_verify)


class _Refused(Exception):
    """A bad input: one line, exit status 2."""


def _open(args: argparse.Namespace) -> tuple[Any, Any]:
    """(tier, signer) for ``args.url`` and ``--config``, as an engine opens them."""
    from kvtier.config import load_config
    from kvtier.errors import KVTierError
    from kvtier.objects import codec
    from kvtier.objects.tiers import open_tier
    from kvtier.objects.tiers.file import FileTier

    extra: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as f:
                loaded = json.load(f)
        except (OSError, ValueError) as exc:
            raise _Refused(f"--config {args.config}: {exc}") from None
        if isinstance(loaded, dict) and isinstance(loaded.get("kv_connector_extra_config"), dict):
            loaded = loaded["kv_connector_extra_config"]
        if not isinstance(loaded, dict):
            raise _Refused(f"--config {args.config}: not a JSON object of kvtier settings")
        extra = dict(loaded)
    env = dict(os.environ)
    if args.url:  # the URL given here wins over the engines' override
        extra["remote_url"] = args.url
        env.pop("KVTIER_REMOTE_URL", None)
    elif not (env.get("KVTIER_REMOTE_URL") or extra.get("remote_url")):
        raise _Refused("no tier: give its URL, or --config with remote_url")
    extra.pop("file_max_bytes", None)  # the engines' own bound; gc takes --max-bytes
    env.pop("KVTIER_FILE_MAX_BYTES", None)
    try:
        cfg = load_config(extra, env)
        signer = codec.Signer.from_config(cfg, env)
        if cfg.remote and cfg.remote.is_local:
            root = cfg.remote.directory
            if not os.path.isdir(root):
                raise _Refused(f"{root}: no such directory")
            # the engines' ledger (a bounded directory) counts what gc and verify delete
            return FileTier(root, background_sweep=False, keep_ledger=True), signer
        return open_tier(cfg), signer
    except KVTierError as exc:
        raise _Refused(str(exc)) from None


def _run(args: argparse.Namespace, what: str, body: Any) -> int:
    from kvtier.errors import KVTierError

    try:
        if getattr(args, "tenant_quotas", None):  # read before the tier is opened
            args.tenant_quotas = read_tenant_quotas(args.tenant_quotas)
        tier, signer = _open(args)
    except _Refused as exc:
        print(f"kvtier store {what}: error: {exc}", file=sys.stderr)
        return 2
    try:
        body(tier, signer)
    except KVTierError as exc:
        print(f"kvtier store {what}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        tier.close()
    return 0


def _when(t: str | None) -> str:
    return "-" if t is None else t.replace("T", " ").removesuffix(":00Z").rstrip("Z")


def usage_table(doc: dict[str, Any]) -> str:
    """``usage``'s JSON as the table printed on a terminal."""
    from kvtier.config.values import format_size

    # HOT: the keys of the generation's hot list (kvtier.hotset), what a warm start fetches
    rows = [
        ["GENERATION", "MODEL", "NAMESPACE", "BYTES", "CHUNKS", "HOT", "FIRST SEEN", "LAST SEEN"]
    ]
    for g in doc["generations"]:
        hot = g.get("hot_chunks")
        rows.append(
            [
                g["id"],
                g["model"] or "-",
                g["namespace"] or "-",
                format_size(g["bytes"]),
                str(g["chunks"]),
                "-" if hot is None else str(hot),
                _when(g["first_seen"]),
                _when(g["last_seen"]),
            ]
        )
    rows.append(
        ["total", "", "", format_size(doc["total_bytes"]), str(doc["total_chunks"]), "", "", ""]
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i in (3, 4, 5) else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    )


def tenant_table(doc: dict[str, Any]) -> str:
    """``usage --by tenant``'s JSON as a table: a row per tenant per generation, then per
    tenant over every generation."""
    from kvtier.config.values import format_size

    rows = [["GENERATION", "MODEL", "TENANT", "BYTES", "CHUNKS"]]
    for g in doc["generations"]:
        for label, n in g["tenants"].items():
            rows.append(
                [g["id"], g["model"] or "-", label, format_size(n["bytes"]), str(n["chunks"])]
            )
    for label, n in doc["tenants"].items():
        rows.append(["total", "", label, format_size(n["bytes"]), str(n["chunks"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i in (3, 4) else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    )


def _usage(args: argparse.Namespace) -> int:
    from kvtier.objects import store_admin

    def body(tier: Any, signer: Any) -> None:
        shown = store_admin.progress_printer()
        found = store_admin.usage(tier, signer, progress=shown)
        if shown is not None:
            shown(0)
        doc = found.to_json(by_tenant=args.by == "tenant")
        if args.json:
            print(json.dumps(doc, indent=2))
            return
        print(tenant_table(doc) if args.by == "tenant" else usage_table(doc))
        for gen, kind in sorted(found.bad_manifests.items()):
            print(
                f"manifest of {gen} does not verify ({kind}): its chunks are counted under unknown"
            )

    return _run(args, "usage", body)


def _gc(args: argparse.Namespace) -> int:
    from kvtier.config.values import format_size
    from kvtier.objects import store_admin

    def body(tier: Any, signer: Any) -> None:
        shown = store_admin.progress_printer()
        plan = store_admin.gc(
            tier,
            signer,
            dead_after_s=args.dead_after,
            max_bytes=args.max_bytes,
            dry_run=args.dry_run,
            progress=shown,
            tenant_quotas=args.tenant_quotas,
        )
        if shown is not None:
            shown(0)
        doc = plan.to_json()
        if args.json:
            print(json.dumps(doc, indent=2))
            return
        verb = "would delete" if args.dry_run else "deleted"
        why = {"dead": "dead", "lru": "least recently used"}
        for row in doc["generations"]:
            reason = why.get(row["reason"]) or f"tenant {row['tenant']} over its quota"
            print(
                f"{verb} {row['chunks']} chunks ({format_size(row['bytes'])}) of "
                f"generation {row['id']} ({row['model'] or 'no manifest'}): {reason}"
            )
        quotas = doc["tenant_quotas"] or {}
        for tenant, n in doc["deleted_by_tenant"].items():
            quota = quotas.get(tenant, quotas.get("*"))
            print(
                f"{verb} {n['chunks']} chunks ({format_size(n['bytes'])}) of tenant "
                f"{tenant}: over its quota of {format_size(quota or 0)}"
            )
        if doc["kept_pinned_chunks"]:
            print(
                f"kept {doc['kept_pinned_chunks']} chunks pinned in their manifest until "
                "their pins expire"
            )
        print(
            f"{verb} {doc['deleted_chunks']} chunks, {format_size(doc['deleted_bytes'])}; "
            f"{format_size(doc['total_bytes_after'])} left of "
            f"{format_size(doc['total_bytes_before'])}"
        )

    return _run(args, "gc", body)


def verify_summary(doc: dict[str, Any], delete_bad: bool) -> str:
    """``verify``'s last line: what was checked, found bad by kind, deleted and kept."""
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(doc["by_kind"].items()))
    line = f"checked {doc['checked']} objects: {doc['bad']} bad" + (f" ({kinds})" if kinds else "")
    if delete_bad:
        done = len(doc["to_delete"])
        line += f"; would delete {done}" if doc["dry_run"] else f"; {done} deleted"
        kept = doc["bad"] - done
        if kept and not doc["delete_refused"]:
            line += (
                f", {kept} kept (manifests, and failures for a key reason or of the "
                "backend, are not corruption)"
            )
    return line


def _verify(args: argparse.Namespace) -> int:
    from kvtier.objects import store_admin

    bad = False

    def body(tier: Any, signer: Any) -> None:
        nonlocal bad
        shown = store_admin.progress_printer()
        report = store_admin.verify(
            tier,
            signer,
            sample=args.sample,
            delete_bad=args.delete_bad,
            dry_run=args.dry_run,
            seed=int(time.time()),
            progress=shown,
        )
        if shown is not None:
            shown(0)
        doc = report.to_json()
        bad = bool(report.bad)
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            for key, kind in doc["bad_keys"].items():
                print(f"bad ({kind}): {key}")
            if args.dry_run:
                for key in doc["to_delete"]:
                    print(f"would delete: {key}")
            print(verify_summary(doc, args.delete_bad))
        if report.refused:
            raise store_admin.StoreError(f"--delete-bad: {report.refused}")

    rc = _run(args, "verify", body)
    return rc if rc else (1 if bad else 0)
