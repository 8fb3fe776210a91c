"""ESMFold2 in MLX: the folding model on top of the ESMC runtime (docs/folding.md)."""
