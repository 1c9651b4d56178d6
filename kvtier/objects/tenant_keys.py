"""Who stored which chunk of a generation: per-tenant chunk lists in its manifest (issue 60).

The host tier knows each chunk's tenant (:mod:`kvtier.host.tenants`: the one whose request
stored it). When the scheduler plans an upload it sends, in the step's metadata, the chunk
keys uploaded per tenant label (``KVTierMetadata.tenant_uploads``: the host tier's labels,
so at most ``tenant_metrics_max`` names, ``untagged`` and ``other``); rank 0's manifest
writer turns them into its object names' fingerprints and adds them, at each refresh, to
the lists its generation's manifest holds (:func:`merge`, read-then-write like the hot
list: a write adds only its own delta). ``kvtier store usage --by tenant`` and ``kvtier
store gc --tenant-quotas`` join these lists with the tier's listing: a chunk's bytes and
last use are the backend's, its tenant the manifest's. Two writers whose read-then-write
of the manifest overlap (milliseconds in a minute) keep one's delta: the other's last
interval of uploads is left unattributed, never attributed wrongly.

A chunk is one tenant's: the last to upload it (a chunk uploaded again was stored again,
its prefill paid again, by that tenant). Bounded: at most :data:`TENANTS` tenant lists per
manifest (later names are ``other``) and :data:`LIMIT` keys in all (8 bytes each, the
first 8 bytes of the object's name: ~11 bytes of base64, ~175 KB at most); past that the
oldest uploads of the longest lists are dropped first (max-min fair: no tenant's flood
drops another's short list). A chunk in no list is *unattributed*: its upload predates
the lists or was dropped from them, or another rank wrote it (rank 0 writes the manifest
and knows only its own object names). A stored list is untrusted input
(:meth:`TenantKeys.from_json`: parsed strictly, bounded).

Soft pins (:class:`Pins`) travel the same way: every :data:`kvtier.hotset.SEND_S` the
scheduler sends the chunks its host tier holds pinned with their time left (a hit renews a
pin there, so the send renews it here), rank 0's writer adds them to the manifest (each
chunk's latest deadline, the expired dropped, at most :data:`PINS_LIMIT`), and ``kvtier
store gc`` deletes no chunk pinned there before its deadline.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "FP_BYTES",
    "LIMIT",
    "OTHER",
    "PINS_LIMIT",
    "TENANTS",
    "UNATTRIBUTED",
    "Pins",
    "TenantKeys",
    "fingerprint",
    "merge",
    "merge_pins",
]

#: the most keys a manifest's tenant lists hold together (with the pins and a hot list of
#: 32-byte keys a manifest stays under 512 KiB, the bound of kvtier versions before them)
LIMIT = 16384
#: the most tenant lists a manifest holds (the host tier's labels: tenant_metrics_max
#: names, untagged, other; engines with other tenants add theirs up to this)
TENANTS = 32
#: bytes of an object name kept per chunk (a 2**-64 chance that two chunks share one)
FP_BYTES = 8
#: the list of every tenant past :data:`TENANTS` (a mix of tenants: no quota trims it)
OTHER = "other"
#: what ``kvtier store usage --by tenant`` calls a chunk in no list
UNATTRIBUTED = "unattributed"
#: a label: a tenant name (kvtier.config.tenants), "untagged" or "other"
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_NAME = re.compile(r"[0-9a-f]{40}", re.ASCII)


def fingerprint(key: str) -> bytes | None:
    """The fingerprint of a chunk's object key (``gen-<id>/<40 hex>`` or a bare name);
    None for anything else (a manifest, another application's key)."""
    name = key.rpartition("/")[2]
    if not _NAME.fullmatch(name):
        return None
    return bytes.fromhex(name[: 2 * FP_BYTES])


@dataclass(frozen=True, slots=True)
class TenantKeys:
    """Per tenant label the fingerprints of the chunks it uploaded, newest first."""

    lists: tuple[tuple[str, tuple[bytes, ...]], ...] = ()

    def __len__(self) -> int:
        return sum(len(keys) for _, keys in self.lists)

    def __bool__(self) -> bool:
        return any(keys for _, keys in self.lists)

    @classmethod
    def of(cls, uploads: Mapping[str, Iterable[str]]) -> TenantKeys:
        """A delta: tenant label -> the object keys it uploaded, in upload order."""
        lists = []
        for label, keys in uploads.items():
            fps = [fp for k in keys if (fp := fingerprint(k)) is not None]
            if fps:
                lists.append((label, tuple(reversed(fps))))
        return merge(cls(tuple(lists)))

    def owners(self) -> dict[bytes, str]:
        """fingerprint -> tenant label."""
        return {fp: label for label, keys in self.lists for fp in keys}

    def to_json(self) -> dict[str, str]:
        """``{label: base64 of its fingerprints, newest first}``."""
        return {label: base64.b64encode(b"".join(keys)).decode() for label, keys in self.lists}

    @classmethod
    def from_json(cls, raw: object) -> TenantKeys:
        """A stored manifest's lists, or ValueError naming what is wrong: not an object,
        more than :data:`TENANTS` lists, a label not a tenant name, a list not base64 of
        whole fingerprints, a fingerprint twice, more than :data:`LIMIT` in all."""
        if not isinstance(raw, dict):
            raise ValueError("tenant lists are not an object")
        if len(raw) > TENANTS:
            raise ValueError(f"{len(raw)} tenant lists (at most {TENANTS})")
        lists: list[tuple[str, tuple[bytes, ...]]] = []
        seen: set[bytes] = set()
        total = 0
        for label, text in raw.items():
            if not isinstance(label, str) or not _LABEL.fullmatch(label):
                raise ValueError("a tenant list's label is not a tenant name")
            if not isinstance(text, str) or len(text) > 4 * (LIMIT * FP_BYTES // 3 + 1):
                raise ValueError(f"tenant list {label!r} is not a short string")
            try:
                blob = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"tenant list {label!r} is not base64") from None
            if len(blob) % FP_BYTES:
                raise ValueError(f"tenant list {label!r} is not whole fingerprints")
            keys = tuple(blob[i : i + FP_BYTES] for i in range(0, len(blob), FP_BYTES))
            total += len(keys)
            if total > LIMIT:
                raise ValueError(f"tenant lists hold more than {LIMIT} keys")
            seen.update(keys)
            if len(seen) != total:
                raise ValueError("tenant lists name a chunk twice")
            if keys:
                lists.append((label, keys))
        return cls(tuple(lists))


def merge(*lists: TenantKeys, limit: int = LIMIT, tenants: int = TENANTS) -> TenantKeys:
    """``lists`` (oldest first: the stored lists, then the deltas sent since) as one: a
    chunk in several is the newest one's; labels keep the order they first appear in, past
    ``tenants`` the rest are :data:`OTHER`; past ``limit`` keys the longest lists lose
    their oldest first."""
    labels: dict[str, str] = {}  # label -> the list it goes to
    for tk in lists:
        for label, _ in tk.lists:
            if label in labels:
                continue
            # one place is kept for "other" while there is anyone to put in it
            room = len(set(labels.values()) - {OTHER}) < tenants - 1 or label == OTHER
            labels[label] = label if room else OTHER
    out: dict[str, list[bytes]] = {to: [] for to in dict.fromkeys(labels.values())}
    seen: set[bytes] = set()
    for tk in reversed(lists):  # newest first: a chunk is the newest uploader's
        for label, keys in tk.lists:
            dest = out[labels[label]]
            for fp in keys:
                if fp not in seen:
                    seen.add(fp)
                    dest.append(fp)
    cap = _fair_cap([len(v) for v in out.values()], limit)
    return TenantKeys(tuple((label, tuple(keys[:cap])) for label, keys in out.items() if keys))


def _fair_cap(lengths: list[int], limit: int) -> int:
    """The longest a list may stay so that all of them hold at most ``limit`` keys, the
    short ones whole (max-min fair)."""
    if sum(lengths) <= limit:
        return max(lengths, default=0)
    left = limit
    ordered = sorted(lengths)
    for i, n in enumerate(ordered):
        share = left // (len(ordered) - i)
        if n > share:
            return share
        left -= n
    return max(lengths)  # not reached: the sum exceeds the limit


#: the most pinned chunks a manifest holds (the latest deadlines kept; ~30 bytes each)
PINS_LIMIT = 2048
#: deadlines a manifest may hold (Unix seconds; 2**33 is the year 2242)
_MAX_TIME = float(2**33)


@dataclass(frozen=True, slots=True)
class Pins:
    """Chunks soft-pinned in a host tier (:mod:`kvtier.host.tenants`), by fingerprint, and
    until when (Unix seconds): ``kvtier store gc`` deletes none of them before then."""

    until: tuple[tuple[bytes, float], ...] = ()

    def __len__(self) -> int:
        return len(self.until)

    def __bool__(self) -> bool:
        return bool(self.until)

    @classmethod
    def of(cls, pins: Mapping[str, float]) -> Pins:
        """A delta: object key -> deadline (Unix seconds)."""
        return merge_pins(
            cls(tuple((fp, t) for k, t in pins.items() if (fp := fingerprint(k)) is not None))
        )

    def live(self, now: float) -> frozenset[bytes]:
        """The fingerprints pinned past ``now``."""
        return frozenset(fp for fp, t in self.until if t > now)

    def to_json(self) -> dict[str, int]:
        """``{base64 fingerprint: deadline, whole seconds rounded up}``."""
        return {base64.b64encode(fp).decode(): int(-(-t // 1)) for fp, t in self.until}

    @classmethod
    def from_json(cls, raw: object) -> Pins:
        """A stored manifest's pins, or ValueError: not an object, more than
        :data:`PINS_LIMIT`, a key not base64 of a fingerprint, a deadline not a time."""
        if not isinstance(raw, dict):
            raise ValueError("pins are not an object")
        if len(raw) > PINS_LIMIT:
            raise ValueError(f"{len(raw)} pins (at most {PINS_LIMIT})")
        out = []
        for text, t in raw.items():
            try:
                fp = base64.b64decode(text, validate=True) if len(text) <= 16 else b""
            except (binascii.Error, ValueError):
                fp = b""
            if len(fp) != FP_BYTES:
                raise ValueError("a pin's key is not base64 of a fingerprint")
            if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < _MAX_TIME:
                raise ValueError("a pin's deadline is not a time")
            out.append((fp, float(t)))
        return cls(tuple(out))


def merge_pins(*pins: Pins, now: float = 0.0, limit: int = PINS_LIMIT) -> Pins:
    """``pins`` as one: each chunk's latest deadline, those past ``now`` dropped, the
    ``limit`` latest kept."""
    until: dict[bytes, float] = {}
    for p in pins:
        for fp, t in p.until:
            if t > now and t > until.get(fp, 0.0):
                until[fp] = t
    kept = sorted(until.items(), key=lambda ft: (-ft[1], ft[0]))[:limit]
    return Pins(tuple(kept))
