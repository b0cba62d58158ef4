"""Tests of the interleaving engine on tiny torch and transformers models (both paths)."""
