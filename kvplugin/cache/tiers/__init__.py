"""Cold tiers: where evicted hot entries go (one module per kind of storage)."""
