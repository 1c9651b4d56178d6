"""The scheduler process's side of the connector: keys and state, no bytes. vLLM's
scheduler hooks (:class:`.side.SchedulerSide`) and the parts it wires; what it tells the
workers is :mod:`kvtier.connectors.metadata`."""
