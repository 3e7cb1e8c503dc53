"""Benchmarks of turnstile: run `python -m bench.run` from the repository root."""
