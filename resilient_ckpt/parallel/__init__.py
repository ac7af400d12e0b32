"""Layer 2 — what ranks decide together: msgpack collectives and the one fail-together
helper, the save distribution (who saves which shard), the load exchange, and
``MCoreTensorAwareStateDict``. Imports ``model`` and ``errors``."""
