"""What more (or less) memory would serve: the what-if ghost tiers of the host tier
(:mod:`kvtier.whatif.host`) and of a directory object tier (:mod:`kvtier.whatif.objects`),
which keep chunk-key fingerprints, never bytes, and their event queue
(:mod:`kvtier.whatif.queue`)."""
