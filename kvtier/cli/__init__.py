"""The ``kvtier`` command (:mod:`kvtier.cli.main`) and what only it uses: ``kvtier size``
and ``kvtier doctor`` over the planner in :mod:`kvtier.sizing`, the load generator behind
``kvtier bench`` (its HTTP client, Prometheus text reader, report), ``kvtier demo`` and
the tiny model the demo builds. Installed as ``kvtier.cli``."""
