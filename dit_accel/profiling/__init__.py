"""Profiling one block: timing, kernel classification, named ranges, validation of the extrapolation."""
