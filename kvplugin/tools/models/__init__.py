"""Offline model builders used by the demo, benchmarks and tests."""
