"""The ``kvtier`` command line: ``size``, ``doctor``, ``bench``, ``demo``, ``store``.

``size`` and ``doctor`` (:mod:`kvtier.cli.size`, :mod:`kvtier.cli.doctor`) build their
flags from the standard library alone and import the planner when they run; ``bench``
and ``demo`` are imported only when used. So ``kvtier size`` starts fast and never
loads torch or vLLM.
"""

from __future__ import annotations

import argparse
import sys

from kvtier import __version__
from kvtier.cli import doctor, size, store

DESCRIPTION = """\
Tiered KV-cache offload for vLLM: a host-RAM tier and a shared object-store tier
behind one KV connector. These commands plan memory before a deployment, check a
running one, and measure what offload buys."""

COMMANDS = {
    "size": "Plan GPU and host memory for a model: KV bytes/token, the GPU KV budget, the "
    "host tier, vLLM weight offload and its pinned-memory cost; --emit prints configs to paste",
    "doctor": "Read a vLLM server log (and optionally a PID) and report what weight offload "
    "and kvtier really did, flagging the silent failures",
    "bench": "Drive an OpenAI-compatible endpoint with a shared-prefix workload and report hit "
    "rate and TTFT",
    "demo": "Run a local vLLM engine with kvtier on a locally built model and show hits and "
    "TTFT saved",
    "store": store.STORE_HELP,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``bench``/``demo`` modules are imported only when that command is used."""
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    size.add_parser(sub, COMMANDS["size"])
    doctor.add_parser(sub, COMMANDS["doctor"])
    store.add_parser(sub, COMMANDS["store"])

    for name in ("bench", "demo"):
        p = sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name] + ".")
        if command == name:
            import importlib

            mod = importlib.import_module(f"kvtier.cli.{name}")
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)
    return parser


def _command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def require_extras(args: argparse.Namespace) -> None:
    """Check the optional libraries a command will import before it starts work, so a
    missing one stops it at once with the extra to install (MissingExtraError), not with
    a ModuleNotFoundError halfway through a run."""
    from kvtier.extras import require

    cmd = args.command
    if cmd == "bench":
        require("httpx", "tqdm", what="kvtier bench")
    elif cmd == "demo":
        require("vllm", what="kvtier demo")
    elif cmd == "size" and getattr(args, "trace", None) and sys.stderr.isatty():
        require("tqdm", what="kvtier size --trace (its progress bar)")
    if getattr(args, "plot", None):
        require("matplotlib", what=f"kvtier {cmd} --plot")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvtier`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from kvtier.extras import MissingExtraError

    try:
        require_extras(args)
        return int(args.func(args) or 0)
    except MissingExtraError as exc:  # also one a command meets later (an object tier's)
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
