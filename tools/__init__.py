"""kvtier's tools that are not planning: the load generator behind ``kvtier bench``,
the local demo (``kvtier demo``) and the tiny random-weight model builder the demo,
the benchmarks and the tests use. Installed as ``kvtier.tools``."""
