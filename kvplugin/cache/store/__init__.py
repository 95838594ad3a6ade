"""store: see the modules."""
