"""Transforms of a model's fp weights before or beside its quantization: rotations folded into the weights
(rotate, hadamard) and KV-head merging (gqa, gqa_pca, gqa_fit)."""
