"""Benchmarks for per_sample_hooks (see benchmarks/run.py)."""
