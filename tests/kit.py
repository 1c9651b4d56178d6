"""What many tests need, in one place: loopback ports. (The connector config every
test and bench builds comes from the product itself: kvtier.sizing.emit.connector_config.)"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
