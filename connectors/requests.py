"""What the scheduler side remembers about one request, and its chunk keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.index import Entry
from kvtier.keys import chunk_block_hashes

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(slots=True)
class Lookup:
    """An object-tier lookup in flight for one request: its chunks from the first one
    the host tier lacked, in order (fetched for it, or already there or being fetched
    for another request)."""

    started: float
    first_chunk: int
    chunks: list[Entry] = field(default_factory=list)
    done: bool = False


@dataclass(slots=True)
class RequestState:
    request: Request
    #: the last block hash of each full chunk so far (the chunks' host-index keys)
    chunk_hashes: list[bytes] = field(default_factory=list)
    #: chunks below this index are stored (or were skipped on purpose)
    next_store: int = 0
    #: (start, end) token range get_num_new_matched_tokens offered
    plan: tuple[int, int] | None = None
    #: tokens vLLM's own prefix cache had, as last passed to get_num_new_matched_tokens
    local_hit: int = 0
    lookup: Lookup | None = None
    hit_sources: dict[str, int] = field(default_factory=dict)
    outcome: str = "miss"
    prefill_done: bool = False


def loadable_chunks(st: RequestState, cap: int, chunk_size: int) -> int:
    """How many of the request's chunks a load may touch: the full chunks vLLM has hashed
    that begin below ``cap`` (the last token vLLM must compute itself ends it; the last
    such chunk may load in part)."""
    return min(len(st.chunk_hashes), -(-cap // chunk_size))


class ChunkKeys:
    """Host-index keys of requests' chunks: vLLM's own hash of a chunk's last block.

    The index belongs to one engine (one model, one namespace), and vLLM's block hash
    already chains the whole prefix, ``cache_salt``, LoRA and multimodal inputs, so it
    identifies the chunk there as it identifies vLLM's own cached blocks; mixing in the
    namespace (what object keys need, shared across engines: ``KeySpace``) would add
    nothing but a hash per chunk and a key string per entry. A lookup makes no hash.
    """

    def __init__(self, blocks_per_chunk: int) -> None:
        self.blocks_per_chunk = blocks_per_chunk

    def refresh(self, st: RequestState) -> None:
        """Take the last block hash of every full chunk vLLM has hashed so far (cheap)."""
        hashes = st.request.block_hashes
        have = len(st.chunk_hashes)
        if len(hashes) // self.blocks_per_chunk > have:
            st.chunk_hashes.extend(chunk_block_hashes(hashes, self.blocks_per_chunk, have))

    @staticmethod
    def key(st: RequestState, c: int) -> bytes:
        """Host-index key of chunk ``c`` (one for all workers: the index is the engine's)."""
        return st.chunk_hashes[c]
