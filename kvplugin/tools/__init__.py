"""Tooling outside the runtime import path: demo, benchmarks, model builders, HTTP client."""
