"""Probe models, third set: sequence / attention recommenders in their authors' idioms
(HSTU as generative-recommenders writes it, TiSASRec, HF/Transformers4Rec BERT blocks,
two-tower retrieval, torch's encoder layer and SDPA masks), at tiny sizes, to find where
gemc breaks (tests/test_probes_sequence_c.py)."""
