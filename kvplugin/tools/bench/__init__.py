"""Side-by-side measurements: stock host vs kvplugin (``kvplugin bench``)."""
