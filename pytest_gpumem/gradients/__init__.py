"""Gradient fingerprints: made from a test's gradients, compared with stored ones, and their schema."""
