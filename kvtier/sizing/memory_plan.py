"""The memory plan: GPU KV budget, warm set, host tier, weight offload and the host check.

Every figure is per GPU / per vLLM worker (one TP rank), because that is how
vLLM budgets ``--cpu-offload-gb`` and how kvtier sizes ``cpu_bytes`` (each
worker holds its own host slab). Fields ending in ``_total`` add up the whole
host: ``tp`` workers plus the headroom left to the OS.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.sizing import offload as off
from kvtier.sizing.compression import resolve as resolve_compression
from kvtier.sizing.model import ModelShape, kv_dtype_bytes, load_shape
from kvtier.sizing.state import StateSpec
from kvtier.sizing.weights import Weights, load_weights

GiB = 1024**3
HOST_TIER_FACTOR = 1.15
DEFAULT_HEADROOM_BYTES = 4 * GiB
DEFAULT_OVERHEAD_GIB = 2.0
OLDEST_OFFLOAD_SAFE_VLLM = (0, 28)

#: every warning the planner and ``kvtier doctor`` can raise; the codes are stable
CODES: dict[str, str] = {
    "offload-ignored-old-vllm": "vLLM < 0.28 silently ignores weight offload on the V2 runner",
    "uva-discarded-by-prefetch": "--cpu-offload-gb is discarded because prefetch offload wins",
    "prefetch-ignored-by-uva": "prefetch flags are ignored with --offload-backend uva",
    "prefetch-without-group-size": "--offload-backend prefetch needs --offload-group-size",
    "prefetch-invalid": "prefetch flags fail vLLM's validation",
    "offload-params-ignored": "offload_params is read by prefetch only, cpu_offload_params by UVA",
    "selector-matches-nothing": "an offload selector matches no parameter",
    "moe-no-experts-selector": "MoE model offloaded without an `experts` selector",
    "pin-rounding-over-host": "power-of-two pin rounding pushes host RAM over the limit",
    "cpu-offload-gb-not-kv": "--cpu-offload-gb moves weights only, never KV cache",
    "host-over-limit": "the plan needs more host RAM than the host has",
    "weights-exceed-gpu": "resident weights leave no GPU memory for KV cache",
    "kv-heads-replicated": "TP is larger than the KV head count; KV heads are replicated",
    "weights-estimate-differs": "the weights estimated from config.json differ from the "
    "checkpoint's size by over 10 % (a float32 checkpoint is cast; a quantized one may be missed)",
    "offload-not-applied": "weight offload was requested but vLLM logged none",
    "kv-load-failure-fails-requests": "kv_load_failure_policy 'fail': a KV load that fails "
    "fails its request, and a local directory tier's lookups take a step of their own",
    "shutdown-loses-queued-writes": "vLLM's stop kills its engine before kvtier flushes the "
    "object-tier writes still queued (--shutdown-timeout, VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)",
    "tier-slower-than-prefill": "the object tier was measured slower than this engine's "
    "prefill: its lookups are declined (load_policy cost) and it serves no hits",
    "host-out-of-memory": "the log shows the host out of memory (Cannot allocate memory, "
    "MemoryError, the kernel's OOM killer)",
    "gpu-out-of-memory": "the log shows the GPU out of memory",
    "worker-killed": "a vLLM process was killed (SIGKILL, or gone with no error of its own): "
    "on a host short of memory, the kernel's OOM killer",
    "worker-died": "a vLLM process died after an error of its own",
    "startup-failed": "the server never came up: the log's first error names why (a kvtier "
    "config error, vLLM's own validation, an engine or worker that died at startup)",
    "state-needs-align-mode": "a hybrid model with recurrent state runs without "
    "--mamba-cache-mode align: vLLM keeps no state at chunk boundaries, kvtier refuses it",
    "state-chunks-not-stored": "a hybrid model with recurrent state computed chunks in "
    "prefill steps that ran past their end: kvtier could not store them",
}


def warning(code: str, message: str) -> dict[str, str]:
    """One warning as it appears in JSON: a stable code and a sentence with the numbers."""
    if code not in CODES:
        raise ValueError(
            f"warning code {code!r} is not one of CODES; add it there with its meaning"
        )
    return {"code": code, "message": message}


def gib(n: float | int | None) -> str:
    """Format bytes as GiB for messages."""
    return "unknown" if n is None else f"{n / GiB:.2f} GiB"


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """``0.27.1``, ``v0.33.0rc1``, ``0.32.0+cpu`` -> (0, 27, 1) etc."""
    if not text:
        return None
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def host_tier_bytes(warm_set_bytes: int, gpu_kv_bytes: int) -> int | None:
    """(warm set - GPU KV) x 1.15; None when the GPU already holds the warm set."""
    need = warm_set_bytes - gpu_kv_bytes
    if need <= 0:
        return None
    return math.ceil(need * HOST_TIER_FACTOR)


def host_total_bytes(
    cpu_bytes: int,
    *,
    weight_offload_host_bytes: int = 0,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    tp: int = 1,
) -> int:
    """Host RAM one vLLM server needs: per worker (host tier + offloaded weights) x TP + headroom.

    This is what a pod's memory request/limit must cover; the Helm chart's tests call it.
    """
    return tp * (cpu_bytes + weight_offload_host_bytes) + headroom_bytes


def k8s_quantity(n: int) -> str:
    """Bytes as a Kubernetes memory quantity, rounded up to a whole Gi (or Mi below 1 Gi)."""
    if n >= GiB:
        return f"{math.ceil(n / GiB)}Gi"
    return f"{max(1, math.ceil(n / 2**20))}Mi"


def parse_k8s_quantity(q: str | int) -> int:
    """Inverse of :func:`k8s_quantity` for the binary and decimal suffixes Kubernetes accepts."""
    if isinstance(q, int):
        return q
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|k|M|G|T)?\s*", q)
    if not m:
        raise ValueError(f"not a Kubernetes memory quantity: {q!r}")
    mult = {
        None: 1,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }[m.group(2)]
    return math.ceil(float(m.group(1)) * mult)


@dataclass(slots=True, kw_only=True)
class PlanInputs:
    """What the operator tells ``kvtier size``; None means "not known"."""

    model: str
    tp: int = 1
    dtype: str | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    overhead_gib: float = DEFAULT_OVERHEAD_GIB
    gpu_kv_gib: float | None = None
    host_memory_gib: float | None = None
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES
    context: int = 8192
    #: vLLM's --max-model-len; None: the config's max_position_embeddings
    max_model_len: int | None = None
    warm_sessions: int | None = None
    offload_backend: str = "auto"
    cpu_offload_gb: float = 0.0
    cpu_offload_params: tuple[str, ...] = ()
    offload_group_size: int = 0
    offload_num_in_group: int = 1
    offload_prefetch_step: int = 1
    offload_params: tuple[str, ...] = ()
    disable_pin_memory: bool | None = None
    vllm_version: str | None = None
    #: kvtier's ``compression`` (object tier only) and, for ``lossless``, a measured
    #: stored ÷ raw to use instead of the README's; ``chunk_size`` as kvtier's
    compression: str = "none"
    compression_ratio: float | None = None
    chunk_size: int = 256
    #: vLLM's --block-size (a sliding-window group's stored blocks are counted in it)
    block_size: int = 16
    #: kvtier's ``cpu_bytes`` per worker when given (``--cpu-bytes``): the host tier the
    #: plan checks, instead of the one it derives from the warm set
    cpu_bytes: int | None = None
    #: vLLM's CPU build: its own KV cache per worker (``VLLM_CPU_KVCACHE_SPACE``), which
    #: with the weights lives in host memory beside kvtier's host tier
    cpu_kv_space_bytes: int | None = None
    #: vLLM's --mamba-cache-dtype and --mamba-ssm-cache-dtype (hybrid models' state)
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    environ: Mapping[str, str] | None = field(default=None, repr=False)


def _offload(
    inp: PlanInputs, weights: Weights, pin: bool, warns: list[dict[str, str]]
) -> off.OffloadResult:
    """Pick the backend as vLLM does and replay it; flag every way it silently misbehaves."""
    backend = off.select_backend(inp.offload_backend, inp.cpu_offload_gb, inp.offload_group_size)
    uva_set, pf_set = inp.cpu_offload_gb > 0, inp.offload_group_size > 0
    if inp.offload_backend == "auto" and uva_set and pf_set:
        warns.append(
            warning(
                "uva-discarded-by-prefetch",
                (
                    f"--cpu-offload-gb {inp.cpu_offload_gb:g} and --offload-group-size "
                    f"{inp.offload_group_size} are both set: vLLM picks prefetch and drops the "
                    "GB budget with only a Python warning. Set one of them (or --offload-backend)."
                ),
            )
        )
    elif inp.offload_backend == "prefetch" and uva_set:
        warns.append(
            warning(
                "uva-discarded-by-prefetch",
                (f"--offload-backend prefetch ignores --cpu-offload-gb {inp.cpu_offload_gb:g}."),
            )
        )
    elif inp.offload_backend == "uva" and pf_set:
        warns.append(
            warning(
                "prefetch-ignored-by-uva",
                ("--offload-backend uva ignores --offload-group-size/--offload-num-in-group."),
            )
        )
    if backend == "uva" and inp.offload_params:
        warns.append(
            warning(
                "offload-params-ignored",
                (
                    f"offload_params {sorted(inp.offload_params)} belongs to the prefetch backend; "
                    "UVA (--cpu-offload-gb) never reads it. Use --cpu-offload-params "
                    "(LLM(cpu_offload_params=...))."
                ),
            )
        )
    if backend == "prefetch" and inp.cpu_offload_params:
        warns.append(
            warning(
                "offload-params-ignored",
                (
                    f"cpu_offload_params {sorted(inp.cpu_offload_params)} belongs to UVA; the "
                    "prefetch backend reads --offload-params (LLM(offload_params=...))."
                ),
            )
        )
    if backend == "none":
        return off.no_offload()
    if backend == "prefetch":
        if inp.offload_group_size <= 0:
            warns.append(
                warning(
                    "prefetch-without-group-size",
                    (
                        "--offload-backend prefetch without --offload-group-size fails vLLM's "
                        f"config validation (offload_num_in_group ({inp.offload_num_in_group}) "
                        "must be <= offload_group_size (0)); the engine does not start."
                    ),
                )
            )
            return off.no_offload()
        try:
            result = off.prefetch_offload(
                weights,
                inp.offload_group_size,
                inp.offload_num_in_group,
                inp.offload_prefetch_step,
                inp.offload_params,
                pin=pin,
            )
        except ValueError as e:
            warns.append(warning("prefetch-invalid", f"{e}; vLLM refuses to start."))
            return off.no_offload()
        selectors = inp.offload_params
    else:
        result = off.uva_offload(weights, inp.cpu_offload_gb, inp.cpu_offload_params, pin=pin)
        selectors = inp.cpu_offload_params
        unspent = result.budget_bytes - result.gpu_bytes
        if unspent > 0 and result.gpu_bytes > 0:  # nothing moved at all: a selector problem
            warns.append(
                warning(
                    "cpu-offload-gb-not-kv",
                    (
                        f"--cpu-offload-gb {inp.cpu_offload_gb:g} asks for "
                        f"{gib(result.budget_bytes)} but only {gib(result.gpu_bytes)} of "
                        f"decoder-layer weights can move; the other {gib(unspent)} does nothing. "
                        "It moves weights only, never KV cache: the KV host tier is kvtier's "
                        "cpu_bytes."
                    ),
                )
            )
    for sel in result.unmatched_selectors:
        warns.append(
            warning(
                "selector-matches-nothing",
                (
                    f"selector {sel!r} matches no parameter. It is matched literally as '.{sel}.' "
                    "inside a name relative to one decoder layer (e.g. "
                    "'self_attn.qkv_proj.weight', 'mlp.experts.w13_weight'): use segments like "
                    "'experts', 'self_attn', 'mlp'; 'layers.N', 'embed_tokens', 'lm_head' and full "
                    "dotted paths match nothing."
                ),
            )
        )
    has_experts = any("experts" in t.name.split(".") for layer in weights.layers for t in layer)
    experts_selected = any("experts" in s.split(".") for s in selectors)
    moved_dense = [t for t in result.tensors if "experts" not in t.name.split(".")]
    if has_experts and not experts_selected and moved_dense:
        moved_experts = len(moved_dense) < len(result.tensors)
        warns.append(
            warning(
                "moe-no-experts-selector",
                (
                    "MoE model offloaded without an 'experts' selector: "
                    f"{gib(sum(t.rank_bytes for t in moved_dense))} of dense weights (read on "
                    "every token) move first"
                    + ("" if moved_experts else " and no expert weights move")
                    + ". Add --cpu-offload-params experts."
                ),
            )
        )
    return result


#: state blocks of each state layer a running request holds on the GPU in align mode
#: (the state being written and the last block boundary's, which vLLM keeps for the
#: prefix cache): the plan counts both so as never to under-count a session
STATE_BLOCKS_PER_REQUEST = 2


def gpu_group_layers(shape: ModelShape, state_layers: int) -> tuple[int, int, int]:
    """Full, sliding-window and state layers as vLLM's KV cache pool holds them: its
    hybrid allocator (``_get_kv_cache_groups_uniform_page_size``) puts every kind's layers
    in groups of one size (the fewest of a kind, or the most when below 1.5 times the
    fewest) and pads each kind's last group; a padded layer costs a page like the others.
    LFM2-1.2B's 10 conv layers beside 6 attention layers cost 12."""
    counts = [sum(1 for k in shape.layer_kinds if k == kind) for kind in ("full", "sliding")]
    counts.append(state_layers)
    present = [c for c in counts if c]
    if len(present) < 2:
        return counts[0], counts[1], counts[2]
    size = min(present)
    if max(present) < 1.5 * size:
        size = max(present)
    full, sliding, state = (-(-c // size) * size for c in counts)
    return full, sliding, state


def state_of(inp: PlanInputs, shape: ModelShape) -> tuple[StateSpec | None, int]:
    """A hybrid model's state layer per rank (None without state) and the block size
    vLLM runs it with (:meth:`ModelShape.engine_state`)."""
    return shape.engine_state(
        inp.block_size,
        inp.kv_cache_dtype,
        inp.tp,
        mamba_cache_dtype=inp.mamba_cache_dtype,
        mamba_ssm_cache_dtype=inp.mamba_ssm_cache_dtype,
        cpu_build=inp.cpu_kv_space_bytes is not None,
    )


def make_plan(inp: PlanInputs, shape: ModelShape | None = None) -> dict[str, Any]:
    """The whole plan as a JSON-ready dict (what ``kvtier size --json`` prints)."""
    shape = shape or load_shape(inp.model, dtype=inp.dtype)
    weights = load_weights(inp.model, shape, inp.tp)
    warns: list[dict[str, str]] = []
    tp = inp.tp

    version = parse_version(inp.vllm_version)
    pin = off.resolve_pin(inp.disable_pin_memory, inp.environ)
    result = _offload(inp, weights, pin, warns)
    ckpt = weights.checkpoint_bytes
    if ckpt and abs(weights.total_bytes - ckpt) * 10 > ckpt:
        warns.append(
            warning(
                "weights-estimate-differs",
                (
                    f"the plan takes the weights as {gib(weights.total_bytes)}, estimated from "
                    f"config.json, but the checkpoint holds {gib(ckpt)} (its safetensors index): a "
                    "float32 checkpoint is cast to the model dtype, a quantized one the estimate "
                    "may miss; for exact figures pass a local directory with the safetensors files"
                ),
            )
        )
    if result.backend != "none" and version is not None and version[:2] < OLDEST_OFFLOAD_SAFE_VLLM:
        warns.append(
            warning(
                "offload-ignored-old-vllm",
                (
                    f"vLLM {inp.vllm_version} silently ignores weight offload on the V2 model "
                    "runner (GPU memory stays as without offload). Upgrade to vLLM >= 0.28 or run "
                    "the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0)."
                ),
            )
        )
    if not shape.is_mla and tp > shape.num_kv_heads:
        warns.append(
            warning(
                "kv-heads-replicated",
                (
                    f"TP {tp} > {shape.num_kv_heads} KV heads: every rank keeps one full KV head, "
                    "so KV bytes per rank do not shrink with TP."
                ),
            )
        )

    bpt = shape.kv_bytes_per_token(inp.kv_cache_dtype)
    bpt_rank = shape.kv_bytes_per_token(inp.kv_cache_dtype, tp)
    # every rank writes its own object of a chunk, except MLA's latent, which every rank
    # holds whole and rank 0 alone writes; each object is compressed on its own
    objects = 1 if shape.is_mla else tp
    # what kvtier stores of one chunk per rank, group by group (a sliding-window group of a
    # hybrid model: only the window before the chunk's end)
    # and of a hybrid model's state layers, one state each per chunk (the chunk end's)
    spec, engine_block = state_of(inp, shape)
    groups = shape.kv_groups(
        inp.kv_cache_dtype, tp, chunk_size=inp.chunk_size, block_size=engine_block, state=spec
    )
    chunk_rank = sum(g["chunk_bytes"] for g in groups)
    state_chunk = spec.bytes if spec else 0
    # on the GPU vLLM pads each state page to one attention layer's page, groups layers
    # in groups of one size (padding the last of a kind: gpu_group_layers), and a running
    # request holds STATE_BLOCKS_PER_REQUEST state pages of each state layer
    per_layer = shape.kv_bytes_per_layer_token(inp.kv_cache_dtype, tp)
    padded_state_page = max(spec.bytes_per_layer, engine_block * per_layer) if spec else 0
    full_l, sliding_l, state_l = gpu_group_layers(shape, spec.layers if spec else 0)
    state_session = state_l * padded_state_page * STATE_BLOCKS_PER_REQUEST
    gpu_bpt = (full_l + sliding_l) * per_layer if spec else bpt_rank

    def session_gpu(context: int) -> int:
        """One sequence on the GPU: its attention KV (for a hybrid model with state in
        whole engine blocks, over the group-padded layers) and its state blocks."""
        if spec is None:
            return shape.session_kv_bytes(context, inp.kv_cache_dtype, tp)
        tokens = -(-context // engine_block) * engine_block
        window = min(tokens, shape.sliding_window or tokens)
        return per_layer * (full_l * tokens + sliding_l * window) + state_session

    comp = resolve_compression(
        inp.compression, kv_dtype_bytes(inp.kv_cache_dtype, shape.dtype), inp.compression_ratio
    )
    obj_comp = {"chunk_size": inp.chunk_size, **comp.summary(chunk_rank, objects)}
    session_rank = session_gpu(inp.context)
    weight_rank = weights.rank_bytes
    resident = weight_rank - result.gpu_bytes + result.buffer_pool_bytes
    overhead = int(inp.overhead_gib * GiB)

    gpu_total = int(inp.gpu_memory_gib * GiB) if inp.gpu_memory_gib is not None else None
    # vLLM's CPU build keeps its KV cache and the weights in host memory, beside the tier
    cpu_build = inp.cpu_kv_space_bytes is not None
    vllm_host = (inp.cpu_kv_space_bytes or 0) + weight_rank if cpu_build else 0
    if inp.gpu_kv_gib is not None:
        gpu_kv: int | None = int(inp.gpu_kv_gib * GiB)
    elif cpu_build and gpu_total is None:
        gpu_kv = inp.cpu_kv_space_bytes  # vLLM's own KV cache is that space
    elif gpu_total is not None:
        gpu_kv = int(inp.gpu_memory_utilization * gpu_total) - resident - overhead
    else:
        gpu_kv = None
    if gpu_kv is not None and gpu_kv <= 0:
        warns.append(
            warning(
                "weights-exceed-gpu",
                (
                    f"{gib(resident)} resident weights + {gib(overhead)} overhead exceed "
                    f"{inp.gpu_memory_utilization:g} x {gib(gpu_total)}: no room for KV cache. "
                    "Offload more weights (--cpu-offload-gb), raise TP, or quantize."
                ),
            )
        )
    gpu_kv_pos = max(gpu_kv, 0) if gpu_kv is not None else None
    tokens = gpu_kv_pos // gpu_bpt if gpu_kv_pos is not None and gpu_bpt else None
    sessions = gpu_kv_pos // session_rank if gpu_kv_pos is not None and session_rank else None

    max_len = inp.max_model_len or shape.max_position_embeddings
    full_rank = session_gpu(max_len) if max_len else 0
    full = gpu_kv_pos // full_rank if gpu_kv_pos is not None and full_rank else None

    # a warm session in the host tier: its tokens' KV and, of a hybrid model, one state
    # per state layer for each whole chunk (kvtier stores states at chunk ends only)
    warm = (
        (bpt_rank * inp.context + state_chunk * (inp.context // inp.chunk_size)) * inp.warm_sessions
        if inp.warm_sessions is not None
        else None
    )
    tier: int | None
    tier_needed: bool | None
    if inp.cpu_bytes is not None:
        tier, tier_needed = inp.cpu_bytes, True
    elif warm is None or gpu_kv_pos is None:
        tier, tier_needed = None, None
    else:
        tier = host_tier_bytes(warm, gpu_kv_pos)
        tier_needed = tier is not None
    tier_for_total = tier if tier is not None else (0 if tier_needed is False else None)
    per_worker_else = result.host_bytes + vllm_host  # host bytes per worker besides the tier
    host_total = (
        host_total_bytes(
            tier_for_total,
            weight_offload_host_bytes=per_worker_else,
            headroom_bytes=inp.headroom_bytes,
            tp=tp,
        )
        if tier_for_total is not None
        else None
    )
    host_mem = int(inp.host_memory_gib * GiB) if inp.host_memory_gib is not None else None
    largest = (
        max(0, (host_mem - inp.headroom_bytes - tp * per_worker_else) // tp)
        if host_mem is not None
        else None
    )
    host_ok = None if host_total is None or host_mem is None else host_total <= host_mem
    if host_ok is False and host_total is not None:
        vllm_text = (
            f" + vLLM CPU build's KV cache {gib(inp.cpu_kv_space_bytes)} and weights "
            f"{gib(weight_rank)}"
            if cpu_build
            else ""
        )
        warns.append(
            warning(
                "host-over-limit",
                (
                    f"host needs {gib(host_total)} (offloaded weights {gib(result.host_bytes)} + "
                    f"host tier {gib(tier_for_total)}{vllm_text} per worker x TP {tp} + headroom "
                    f"{gib(inp.headroom_bytes)}) but has {gib(host_mem)}; the largest cpu_bytes "
                    f"that fits is {largest} ({gib(largest)}) per worker."
                ),
            )
        )
        exact_total = host_total - tp * (result.host_bytes - result.gpu_bytes)
        if result.host_bytes > result.gpu_bytes and exact_total <= (host_mem or 0):
            warns.append(
                warning(
                    "pin-rounding-over-host",
                    (
                        f"pinning rounds the {gib(result.gpu_bytes)} of offloaded weights up to "
                        f"{gib(result.host_bytes)} per worker, which pushes the host over its "
                        f"{gib(host_mem)}; VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1 (or "
                        "--disable-pin-memory here) keeps the exact size."
                    ),
                )
            )
    gpu_ok = None if gpu_kv is None else gpu_kv > 0
    if gpu_ok is False or host_ok is False:
        fits: bool | None = False
    elif gpu_ok is None or host_ok is None:
        fits = None
    else:
        fits = True

    return {
        "model": inp.model,
        "model_type": shape.model_type,
        "tp": tp,
        "dtype": shape.dtype,
        "kv_cache_dtype": inp.kv_cache_dtype,
        "num_layers": shape.num_layers,
        "kv_layers": shape.attention_layers,
        "num_kv_heads": shape.num_kv_heads,
        "kv_heads_per_rank": None if shape.is_mla else shape.kv_heads_per_rank(tp),
        "head_dim": shape.head_dim,
        "mla": shape.is_mla,
        "sliding_window": shape.sliding_window,
        "sliding_layers": sum(1 for k in shape.layer_kinds if k == "sliding"),
        # a hybrid model's recurrent state (Mamba, gated delta-net, short conv), per rank:
        # one state per state layer per chunk in kvtier's tiers; on the GPU each state
        # page padded to an attention page, in vLLM's (raised) block size
        "state_layers": spec.layers if spec else 0,
        "state_kind": spec.kind if spec else None,
        "state_bytes_per_layer": spec.bytes_per_layer if spec else 0,
        "state_bytes_per_chunk": state_chunk,
        "state_padded_page_bytes": padded_state_page,
        # the layers vLLM's pool pays a page for, its group padding included
        "gpu_group_layers": {"full": full_l, "sliding": sliding_l, "state": state_l},
        # the dtypes the state is held in (conv, SSM), the flags' auto resolved
        "state_dtypes": list(spec.dtypes) if spec else None,
        "block_size": inp.block_size,
        "engine_block_size": engine_block,
        "kv_bytes_per_token": bpt,
        "kv_bytes_per_token_per_rank": bpt_rank,
        # what the object tier stores per token: every rank's share, except MLA's latent,
        # which every rank holds whole and rank 0 alone writes
        "object_kv_bytes_per_token": chunk_rank * objects // inp.chunk_size,
        # per KV cache group (vLLM's hybrid manager keeps full and sliding layers apart):
        # bytes per token and per block per rank, and what kvtier stores of a chunk
        "kv_groups": groups,
        "host_chunk_bytes_per_rank": chunk_rank,
        "host_slot_bytes": (chunk_rank + 4095) // 4096 * 4096,
        # what it stores per token under ``compression`` (the host tier is never compressed)
        "object_stored_bytes_per_token": obj_comp["stored_chunk_bytes"] / inp.chunk_size,
        "object_compression": obj_comp,
        "context": inp.context,
        "session_kv_bytes_per_rank": session_rank,
        "weights_source": weights.source,
        "weight_bytes": weights.total_bytes,
        "checkpoint_bytes": weights.checkpoint_bytes,
        "weight_bytes_per_rank": weight_rank,
        "offload_backend": result.backend,
        "pin_memory": pin,
        "weight_offload_budget_bytes": result.budget_bytes,
        "weight_offload_gpu_bytes": result.gpu_bytes,
        "weight_offload_host_bytes": result.host_bytes,
        "weight_offload_tensors": len(result.tensors),
        "weight_offload_layers": result.layers_touched,
        "prefetch_buffer_bytes": result.buffer_pool_bytes,
        "resident_weight_bytes": resident,
        "gpu_memory_bytes": gpu_total,
        "gpu_memory_utilization": inp.gpu_memory_utilization,
        "overhead_bytes": overhead,
        "gpu_kv_bytes": gpu_kv,
        "gpu_kv_tokens": tokens,
        "gpu_kv_sessions": sessions,
        "max_model_len": max_len,
        "gpu_kv_full_context_sessions": full,
        "warm_sessions": inp.warm_sessions,
        "warm_set_bytes": warm,
        "host_tier_needed": tier_needed,
        "host_tier_bytes": tier,
        # --cpu-bytes as given (None: the tier above is derived from the warm set)
        "cpu_bytes": inp.cpu_bytes,
        # vLLM's CPU build, per worker: its KV cache (VLLM_CPU_KVCACHE_SPACE) and, with
        # the weights, what it holds in host memory beside the tier; None on a GPU
        "vllm_cpu_kv_bytes": inp.cpu_kv_space_bytes,
        "vllm_cpu_host_bytes": vllm_host if cpu_build else None,
        # the largest cpu_bytes (per worker) the host memory holds beside everything else
        "largest_cpu_bytes_that_fits": largest,
        "headroom_bytes": inp.headroom_bytes,
        "host_memory_bytes": host_mem,
        "host_bytes_total": host_total,
        "fits": fits,
        "warnings": warns,
    }
