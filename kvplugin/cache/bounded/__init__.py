"""bounded: see the modules."""
