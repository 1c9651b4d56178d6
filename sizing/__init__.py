"""The memory planner and the ``kvtier`` command line. Imports neither torch nor vLLM at module level."""
