"""Benchmarking: prompt categories, offline runs against the K = 0 baseline, peer runs, reports."""
