"""The worker processes' side of the connector: bytes. Each worker runs the ops the
scheduler planned (:class:`.side.WorkerSide`) through its copier and its object tier, and
reports their results in :mod:`kvtier.connectors.metadata`."""
