"""Benchmarks: load generation, and what the gateway adds over an engine."""
