"""The simulation behind ``kvtier size --trace``: vLLM's GPU prefix cache as a block
LRU in front, then the tier's LRU stack (Mattson's stack distances, depths counted
with a Fenwick tree): one pass gives the hit rate of every tier size."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.keys import chunk_block_hashes, token_block_hashes
from kvtier.sizing.trace.read import TraceRequest

DEFAULT_MAX_CHUNKS = 1 << 20


def _key(h: bytes) -> int:
    """64 bits of a hash as an int: a quarter of the memory of the bytes object."""
    return int.from_bytes(h[:8], "little")


def hash_id_keys(req: TraceRequest, step: int) -> list[int]:
    """Keys of a hash-id request's prefixes of ``step``, ``2 * step``, ... tokens (its
    full vLLM blocks, or its full chunks), without expanding the tokens.

    A prefix of L tokens is the blocks before the one holding token L and the first
    tokens of that one: its key is the chain of hash ids up to that block (and the line's
    ``cache_salt``) with the offset in it. Two prefixes get one key exactly when their
    tokens are the same, were every id expanded to its own tokens
    (tests/sizing/trace/test_trace_hash_ids.py checks this against :func:`expand_tokens`).
    """
    if req.hash_ids is None:
        raise ValueError("hash_id_keys takes a hash-id line's request, not token ids")
    bs = req.block_size
    p = hash(("kvtier-cache-salt", req.cache_salt)) if req.cache_salt else 0
    chain = []
    for h in req.hash_ids:
        p = hash((p, h))
        chain.append(p)
    return [
        hash((chain[(end - 1) // bs], (end - 1) % bs)) for end in range(step, req.length + 1, step)
    ]


class GpuPrefixCache:
    """vLLM's prefix cache as a block LRU of ``blocks`` blocks, one request at a time.

    A request hits the longest run of cached blocks from its start (at most up to its
    last token, which vLLM always computes); then all its full blocks are cached. vLLM
    frees a finished request's blocks tail first, so its first block is evicted last:
    blocks are touched in reverse order here for the same effect.
    """

    def __init__(self, blocks: int) -> None:
        self.blocks = max(0, blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def serve(self, keys: list[int], max_blocks: int) -> int:
        """Blocks of this request vLLM's cache already had; then caches all of them."""
        if self.blocks == 0:
            return 0
        hit = 0
        while hit < min(len(keys), max_blocks) and keys[hit] in self._lru:
            hit += 1
        for k in reversed(keys):
            self._lru[k] = None
            self._lru.move_to_end(k)
        while len(self._lru) > self.blocks:
            self._lru.popitem(last=False)
        return hit


class LruStack:
    """Depth of each key in an LRU stack (1 = most recently used), for the ``limit``
    most recent keys; older keys are forgotten, so memory stays bounded.

    Every access gets a new timestamp; a Fenwick tree counts live timestamps, so a
    key's depth is the number of live timestamps at or after its own. Timestamps are
    renumbered when they run out (amortized O(1) per access); the tree grows with the
    keys held, so memory follows the trace's distinct chunks, not ``limit``.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self._cap = min(2 * limit + 2, 4096)
        self._tree = array("q", bytes(8 * (self._cap + 1)))
        self._ts: OrderedDict[int, int] = OrderedDict()
        self._next = 1

    def __len__(self) -> int:
        return len(self._ts)

    def _add(self, i: int, delta: int) -> None:
        tree, cap = self._tree, self._cap
        while i <= cap:
            tree[i] += delta
            i += i & -i

    def _prefix(self, i: int) -> int:
        tree, s = self._tree, 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    def depth(self, key: int) -> int | None:
        """Stack depth of ``key`` now, or None if it was never seen (or forgotten)."""
        ts = self._ts.get(key)
        if ts is None:
            return None
        return len(self._ts) - self._prefix(ts - 1)

    def access(self, key: int) -> None:
        """Make ``key`` the most recently used."""
        old = self._ts.pop(key, None)
        if old is not None:
            self._add(old, -1)
        if self._next > self._cap:
            self._compact()
        self._ts[key] = self._next
        self._add(self._next, 1)
        self._next += 1
        if len(self._ts) > self.limit:
            _, ts = self._ts.popitem(last=False)
            self._add(ts, -1)

    def _compact(self) -> None:
        # at least as many free timestamps as live ones after the renumbering
        self._cap = max(self._cap, 2 * len(self._ts) + 2)
        tree = self._tree = array("q", bytes(8 * (self._cap + 1)))
        cap = self._cap
        for i, k in enumerate(self._ts, 1):
            self._ts[k] = i
            tree[i] += 1
            j = i + (i & -i)
            if j <= cap:
                tree[j] += tree[i]
        # the loop above built partial sums only for live positions; finish the rest
        for i in range(len(self._ts) + 1, cap + 1):
            j = i + (i & -i)
            if j <= cap:
                tree[j] += tree[i]
        self._next = len(self._ts) + 1


@dataclass(slots=True)
class Simulation:
    """Totals and the depth histogram of one pass over a trace."""

    block_size: int
    chunk_size: int
    gpu_blocks: int
    max_chunks: int = DEFAULT_MAX_CHUNKS
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    #: hit_tokens[d]: prompt tokens a tier of d or more chunks serves beyond vLLM's cache
    #: that a tier of d-1 chunks does not (index 0 unused)
    hit_tokens: array[int] = field(default_factory=lambda: array("q"))
    distinct_chunks: int = 0
    #: full chunks of the longest prompt: below that many slots the model is not exact
    max_request_chunks: int = 0
    _gpu: GpuPrefixCache = field(init=False)
    _stack: LruStack = field(init=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.chunk_size % self.block_size:
            raise ValueError("chunk_size must be a multiple of block_size")
        self._gpu = GpuPrefixCache(self.gpu_blocks)
        self._stack = LruStack(self.max_chunks)
        self.hit_tokens = array("q", [0])

    def add(self, req: TraceRequest) -> None:
        """Run one request through vLLM's cache, then through the tier's LRU stack."""
        bs, cs = self.block_size, self.chunk_size
        if req.hash_ids is not None:
            n = req.length
            gpu_keys, keys = hash_id_keys(req, bs), hash_id_keys(req, cs)
        else:
            n = len(req.token_ids)
            blocks = token_block_hashes(req.token_ids, bs, req.cache_salt)
            gpu_keys = [_key(h) for h in blocks]
            keys = [_key(h) for h in chunk_block_hashes(blocks, cs // bs)]
        self.prompt_tokens += n
        cap = (n - 1) // bs * bs  # vLLM computes the last prompt token itself
        local = self._gpu.serve(gpu_keys, cap // bs) * bs
        self.gpu_hit_tokens += local
        stack = self._stack
        depths = [stack.depth(k) for k in keys]  # the lookup sees the tier before stores
        deepest = 0
        for c in range(local // cs, len(keys)):
            d = depths[c]
            if c * cs >= cap or d is None:
                break
            deepest = max(deepest, d)
            tokens = min((c + 1) * cs, cap) - max(c * cs, local)
            if tokens > 0:
                while len(self.hit_tokens) <= deepest:
                    self.hit_tokens.extend([0] * max(64, len(self.hit_tokens)))
                self.hit_tokens[deepest] += tokens
        for k in keys:  # every full chunk is then stored or touched, in order
            stack.access(k)
        self.distinct_chunks = max(self.distinct_chunks, len(stack))
        self.max_request_chunks = max(self.max_request_chunks, len(keys))

    def served(self) -> list[int]:
        """served[s]: tokens a tier of s chunks serves beyond vLLM's cache (s = 0..max)."""
        out, total = [0], 0
        for d in range(1, len(self.hit_tokens)):
            total += self.hit_tokens[d]
            out.append(total)
        return out
