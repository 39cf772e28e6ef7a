"""compress: quantize, export and serve causal language models."""
