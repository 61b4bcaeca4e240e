"""Probe models: other people's sequence / attention idioms, written as their authors do,
at tiny sizes, to find where gemc breaks (tests/test_probes_sequence.py)."""
