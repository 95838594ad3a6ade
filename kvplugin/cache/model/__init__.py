"""model: see the modules."""
