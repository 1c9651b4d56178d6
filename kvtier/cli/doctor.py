"""``kvtier doctor``: what a vLLM server log (and the process) says weight offload and
kvtier really did, beside the plan for the same flags when ``--model`` is given."""

from __future__ import annotations

import argparse
import json
import sys

from kvtier.cli.engine_flags import add_plan_args, plan_inputs

DOCTOR_EPILOG = """\
vLLM logs the UVA offload in GiB and the prefetch offload in GB; both are shown as
printed and converted. Warning codes are the same as `kvtier size`, plus
host-out-of-memory, gpu-out-of-memory, worker-killed, worker-died and startup-failed
from the log. A server that never came up is named first, in one line, with its cause.
Exit status: 0 no warning, 1 warnings, 2 no log (a terminal on stdin), a log that
cannot be read, or input with no vLLM log line, 3 the server did not start."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], help_text: str) -> None:
    """``kvtier doctor`` under the ``kvtier`` command's subparsers."""
    doc = sub.add_parser(
        "doctor",
        help=help_text,
        description=help_text + ".",
        epilog=DOCTOR_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doc.add_argument("log", nargs="?", help="vLLM server log file ('-' or omitted: stdin)")
    doc.add_argument("--pid", type=int, help="vLLM process to read VmRSS/RssShmem from")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    add_plan_args(doc, model_required=False)
    doc.set_defaults(func=_doctor, parser=doc)


def _doctor(args: argparse.Namespace) -> int:
    from kvtier.sizing import doctor

    if args.log is None and sys.stdin.isatty():
        # nothing piped in: say how to use it rather than wait on the terminal
        args.parser.print_help()
        return 2
    name = "stdin" if args.log in (None, "-") else args.log
    try:
        if args.log in (None, "-"):
            facts = doctor.parse_log(sys.stdin)
        else:
            with open(args.log, encoding="utf-8", errors="replace") as f:
                facts = doctor.parse_log(f)
    except (OSError, UnicodeDecodeError) as e:
        print(f"kvtier doctor: error: cannot read {name}: {e}", file=sys.stderr)
        return 2
    if not doctor.read_anything(facts):
        print(
            f"kvtier doctor: error: {name} holds no vLLM log line (none in vLLM's "
            "'INFO MM-DD hh:mm:ss [file.py:N]' form, no memory or process error): "
            "pass the server's log",
            file=sys.stderr,
        )
        return 2
    proc = None
    if args.pid is not None:
        try:
            proc = doctor.read_proc_status(args.pid)
        except OSError as e:
            print(f"kvtier doctor: error: cannot read process {args.pid}: {e}", file=sys.stderr)
            return 2
    plan = None
    if args.model:
        from kvtier.sizing.memory_plan import make_plan
        from kvtier.sizing.model import ModelConfigError

        a = facts["args"]
        args.cpu_offload_gb = args.cpu_offload_gb or float(a.get("cpu_offload_gb", 0))
        args.offload_group_size = args.offload_group_size or int(a.get("offload_group_size", 0))
        args.cpu_offload_params = args.cpu_offload_params or a.get("cpu_offload_params")
        args.offload_params = args.offload_params or a.get("offload_params")
        args.vllm_version = args.vllm_version or facts["vllm_version"]
        if args.tp == 1 and a.get("tensor_parallel_size"):
            args.tp = int(a["tensor_parallel_size"])
        # the object tier as the logged kvtier config stores it
        cfg = facts.get("kvtier_config") or {}
        if cfg.get("compression") in ("none", "lossless", "fp8"):
            args.compression = cfg["compression"]
        if isinstance(cfg.get("chunk_size"), int) and cfg["chunk_size"] > 0:
            args.chunk_size = cfg["chunk_size"]
        try:
            plan = make_plan(plan_inputs(args))
        except (ModelConfigError, ValueError, KeyError) as e:
            print(f"kvtier doctor: error: {e}", file=sys.stderr)
            return 2
    rep = doctor.report(facts, proc, plan)
    print(json.dumps(rep, indent=2) if args.json else doctor.format_report(rep))
    if rep["startup_failure"]:  # stronger than a warning: nothing was served at all
        return 3
    return 1 if rep["warnings"] else 0
