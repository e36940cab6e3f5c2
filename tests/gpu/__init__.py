"""Tests that need CUDA (skipped elsewhere)."""
