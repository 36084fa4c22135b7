"""Drafter training: prompt sets disjoint from the benchmark (`prompts`), then self-distillation data."""
