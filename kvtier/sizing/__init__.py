"""The memory planner and the ``kvtier`` command line.

Nothing here imports torch or vLLM at module level, so ``kvtier size`` starts
in well under a second and the connector can size its host tier cheaply.
"""
