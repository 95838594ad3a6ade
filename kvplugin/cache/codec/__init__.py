"""codec: see the modules."""
