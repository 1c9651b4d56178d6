"""The host tier: the chunk index, the pinned host slab and the copies between vLLM's
paged KV cache and host slots (CPU or CUDA streams). Imports nothing from
``kvtier.objects``."""
