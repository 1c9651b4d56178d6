"""kvtier's log lines reach vLLM's log (connectors/vllm.py ``log_where_vllm_logs``)."""

from __future__ import annotations

import io
import logging

from kvtier.connectors.vllm import log_where_vllm_logs


def test_kvtier_info_lines_go_to_vllms_handlers() -> None:
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    saved = (list(ours.handlers), ours.level, list(theirs.handlers), theirs.level)
    out = io.StringIO()
    try:
        ours.handlers, theirs.handlers = [], [logging.StreamHandler(out)]
        ours.setLevel(logging.NOTSET)
        theirs.setLevel(logging.INFO)
        log_where_vllm_logs()
        log_where_vllm_logs()  # idempotent: one handler, one line per record
        logging.getLogger("kvtier.scheduler").info("lookups answer in their own step")
        logging.getLogger("kvtier.scheduler").debug("not at INFO")
        assert out.getvalue() == "lookups answer in their own step\n"
    finally:
        ours.handlers, ours.level, theirs.handlers, theirs.level = saved
