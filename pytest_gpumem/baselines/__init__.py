"""Stored baselines: the file's schema, its guarded reads and locked atomic writes, updates, comparison."""
