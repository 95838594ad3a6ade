"""memory: see the modules."""
