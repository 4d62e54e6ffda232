"""Benchmark scripts that print measured ratios (speed, memory); never run as unit tests."""
