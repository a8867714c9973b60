"""Benchmarks: cases, harness, JSON results under bench/results/."""
