"""Who a request is: ``kv_transfer_params`` -> ``{"kvtier": {"tenant": "team-a",
"pin_ttl_s": 3600}}`` read once per request on the scheduler side (issue 60).

vLLM hands a request's ``kv_transfer_params`` (the OpenAI request's field of that name) to
the connector as ``Request.kv_transfer_params``. A request naming no tenant is the
``default_tenant``'s (or untagged). A request is never refused for what it says here: a
bad name, a bad TTL, a pin from a tenant not in ``pin_tenants`` are logged as an error
(each kind of mistake once per process, so a client cannot flood the log) and the request
runs untagged, or unpinned.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.config.tenants import MAX_PIN_TTL_S, tenant_name_problem
from kvtier.host.index import ChunkIndex
from kvtier.host.tenants import UNTAGGED, Tenancy
from kvtier.hotset import SEND_S
from kvtier.objects.tenant_keys import PINS_LIMIT

from ..metadata import KVTierMetadata
from .requests import RequestState

logger = logging.getLogger("kvtier.scheduler")

#: the keys kvtier reads under kv_transfer_params["kvtier"]
PARAMS = ("tenant", "pin_ttl_s")


class RequestTenants:
    """Tags each request's state with its tenant id and pin TTL."""

    def __init__(self, cfg: KVTierConfig, tenancy: Tenancy) -> None:
        self.tenancy = tenancy
        self.default = tenancy.tenant_id(cfg.default_tenant)
        #: the kinds of mistake logged already (bounded: one per kind)
        self._logged: set[str] = set()
        #: pins are sent to the manifest every pins_send_s, when anyone may pin
        self.sends_pins = bool(cfg.pin_tenants)
        self.pins_send_s = SEND_S
        self.clock = time.monotonic
        self._pins_sent_at: float | None = None

    def pins_to_send(self) -> dict[bytes, float] | None:
        """Every ``pins_send_s`` (from the first call): the chunks the host tier holds
        pinned and the seconds each has left (``KVTierMetadata.pins``: rank 0's manifest
        writer records them, and ``kvtier store gc`` keeps those chunks until then; a hit
        renews a pin, and the next send its deadline). None: not time yet, or no pin."""
        if not self.sends_pins:
            return None
        now = self.clock()
        if self._pins_sent_at is None:
            self._pins_sent_at = now
        if now - self._pins_sent_at < self.pins_send_s:
            return None
        self._pins_sent_at = now
        return self.tenancy.pins_left(PINS_LIMIT) or None

    def tag(self, st: RequestState) -> None:
        params = getattr(st.request, "kv_transfer_params", None)
        ours = params.get("kvtier") if isinstance(params, dict) else None
        st.tenant, st.pin_ttl_s = self.default, 0.0
        if ours is None:
            return
        if not isinstance(ours, dict):
            self._error(
                "params",
                'kv_transfer_params["kvtier"] is not an object: %s; the request runs untagged',
                _short(ours),
            )
            st.tenant = UNTAGGED
            return
        unknown = sorted(str(k) for k in ours if k not in PARAMS)
        if unknown:
            self._error(
                "unknown",
                'kv_transfer_params["kvtier"] keys %s are not read (known: %s)',
                unknown[:8],
                ", ".join(PARAMS),
            )
        name = ours.get("tenant")
        if name is not None:
            problem = tenant_name_problem(name)
            if problem is not None:
                self._error(
                    "tenant",
                    "request %s: tenant %r refused (%s); it runs untagged",
                    st.request.request_id,
                    _short(name),
                    problem,
                )
                st.tenant = UNTAGGED
                return
            st.tenant = self.tenancy.tenant_id(name)
            if st.tenant == UNTAGGED:
                self._error(
                    "too_many",
                    "more than %d tenants: request %s of tenant %r runs untagged",
                    len(self.tenancy.names),
                    st.request.request_id,
                    name,
                )
        ttl = ours.get("pin_ttl_s")
        if ttl is None:
            return
        if (
            isinstance(ttl, bool)
            or not isinstance(ttl, int | float)
            or not math.isfinite(ttl)
            or not 0 < ttl <= MAX_PIN_TTL_S
        ):
            self._error(
                "ttl",
                "request %s: pin_ttl_s %r refused (a number of seconds > 0 and <= %d); not pinned",
                st.request.request_id,
                _short(ttl),
                MAX_PIN_TTL_S,
            )
        elif not self.tenancy.may_pin[st.tenant]:
            self._error(
                f"pin:{st.tenant}",
                "tenant %r may not pin (not in pin_tenants): request %s runs unpinned",
                self.tenancy.names[st.tenant] or "untagged",
                st.request.request_id,
            )
        else:
            st.pin_ttl_s = float(ttl)

    def _error(self, kind: str, msg: str, *args: Any) -> None:
        """Log once per kind of mistake (and per tenant refused a pin: a bounded set)."""
        if kind in self._logged:
            return
        self._logged.add(kind)
        logger.error("kvtier: " + msg + " (logged once)", *args)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def uploads_by_tenant(
    index: ChunkIndex, tenancy: Tenancy, meta: KVTierMetadata
) -> dict[str, list[bytes]] | None:
    """The chunk keys the step uploads, per tenant label (the tenant who stored each, as
    the host tier knows it; at most ``tenant_metrics_max`` names, ``untagged``, ``other``):
    ``KVTierMetadata.tenant_uploads``, which rank 0's manifest writer adds to its
    generation's tenant lists (:mod:`kvtier.objects.tenant_keys`). None: no upload."""
    keys = [op.block_hash for op in meta.stores if op.upload_op_id is not None]
    keys += [op.block_hash for op in meta.uploads]
    if not keys:
        return None
    out: dict[str, list[bytes]] = {}
    for key in keys:
        entry = index.get(key)
        label = tenancy.label(entry.tenant if entry is not None else UNTAGGED)
        out.setdefault(label, []).append(key)
    return out
