"""Utilities for users: learning curves from metrics.jsonl, summaries of profiler traces,
and the docs' table of ahead-of-time compile reports."""
