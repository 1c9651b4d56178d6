"""What many tests need, in one place: loopback ports, the chunks a directory tier
holds. (The connector config every test and bench builds comes from the product
itself: kvtier.sizing.emit.connector_config.)"""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chunk_files(root: Path) -> list[Path]:
    """The chunk objects a file:// tier holds: its own bookkeeping (the sweep lock, temp
    files of writes in flight) is dot-named."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
