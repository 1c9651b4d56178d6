"""Hit-rate curves from a request trace: ``kvtier size --model M --trace FILE``.

An operator buying host RAM and object storage needs "what hit rate does each size
give for *my* traffic", not a guess of warm sessions. kvtier's keys are a pure
function of the prompt tokens, so one pass over a trace answers it for every size at
once: vLLM's GPU prefix cache is simulated in front (block LRU, a fixed size), and the
chunk keys it does not serve are run through an LRU stack (Mattson's stack distances,
depths counted with a Fenwick tree), which gives the hit rate of every LRU tier size
from one histogram.

Keys are made as the connector makes them: :func:`kvtier.keys.token_block_hashes`
builds vLLM's chain of block hashes (tokens, parent, ``cache_salt``) and
:func:`kvtier.keys.chunk_block_hashes` — the very function the connector calls —
cuts it into chunks. Hits follow the scheduler's rules: the last prompt token is
always computed, vLLM's own hit comes first, kvtier serves the run of chunks after it
up to the first chunk it lacks, and every full chunk of a prompt is then stored or
touched in order.

Memory is bounded: the trace is streamed line by line, no line's prompt is over
:data:`MAX_INPUT_LENGTH` tokens however it is given (hash ids without ``input_length``
included: those lines are bad lines, counted), the GPU model holds at most its own size,
and the stack tracks at most ``max_chunks`` keys (deeper keys count as misses at every
size, so the curve is exact up to that many chunks).

Reading is :mod:`kvtier.sizing.trace.read`, the simulation
:mod:`kvtier.sizing.trace.sim`, the report and plot :mod:`kvtier.sizing.trace.report`;
the package itself runs them over a file and names what ``kvtier size --trace`` uses.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.sizing.trace.read import (
    BAILIAN_FIELDS,
    HASH_BLOCK_SIZE,
    MAX_HASH_ID,
    MAX_INPUT_LENGTH,
    MAX_LINE_BYTES,
    MAX_TOKEN_ID,
    MAX_TRACE_BLOCK_SIZE,
    TRACE_FORMATS,
    Tokenizer,
    TraceError,
    TraceFormat,
    TraceRequest,
    TraceStats,
    block_size_error,
    block_tokens,
    expand_tokens,
    parse_line,
    read_trace,
    truncate,
)
from kvtier.sizing.trace.report import (
    CURVE_POINTS,
    SLOT_ALIGN,
    format_report,
    report,
    slot_bytes,
    write_plot,
)
from kvtier.sizing.trace.sim import (
    DEFAULT_MAX_CHUNKS,
    GpuPrefixCache,
    LruStack,
    Simulation,
    hash_id_keys,
)

__all__ = [
    "BAILIAN_FIELDS",
    "CURVE_POINTS",
    "DEFAULT_MAX_CHUNKS",
    "GpuPrefixCache",
    "HASH_BLOCK_SIZE",
    "LruStack",
    "MAX_HASH_ID",
    "MAX_INPUT_LENGTH",
    "MAX_LINE_BYTES",
    "MAX_TOKEN_ID",
    "MAX_TRACE_BLOCK_SIZE",
    "SLOT_ALIGN",
    "Simulation",
    "TRACE_FORMATS",
    "Tokenizer",
    "TraceError",
    "TraceFormat",
    "TraceRequest",
    "TraceStats",
    "block_size_error",
    "block_tokens",
    "expand_tokens",
    "format_report",
    "hash_id_keys",
    "parse_line",
    "plan_trace",
    "read_trace",
    "report",
    "slot_bytes",
    "truncate",
    "write_plot",
]

#: every line read by its own fields (``--trace-format auto``)
DEFAULT_FORMAT = TraceFormat()


def plan_trace(
    path: str,
    *,
    tokenizer: str | None,
    block_size: int,
    chunk_size: int,
    gpu_kv_tokens: int,
    max_chunks: int = DEFAULT_MAX_CHUNKS,
    progress: bool = False,
    on_request: Callable[[TraceRequest], None] | None = None,
    form: TraceFormat = DEFAULT_FORMAT,
    max_input_tokens: int | None = None,
) -> tuple[Simulation, TraceStats]:
    """One streamed pass over a trace file (prompts cut to ``max_input_tokens`` as
    ``kvtier bench --trace`` cuts them). A hash block size that does not fit the chunk
    size is a :class:`TraceError`."""
    stats = TraceStats()
    sim = Simulation(block_size, chunk_size, gpu_kv_tokens // block_size, max_chunks)
    checked: set[int] = set()
    for req in read_trace(path, Tokenizer(tokenizer), stats, progress, form):
        if req.hash_ids is not None and req.block_size not in checked:
            if err := block_size_error(chunk_size, req.block_size):
                raise TraceError(err)
            checked.add(req.block_size)
        if max_input_tokens is not None:
            truncate(req, max_input_tokens)
        sim.add(req)
        if on_request is not None:
            on_request(req)
    return sim, stats
