"""service: see the modules."""
