"""Evaluation, benchmarks and the demo."""
