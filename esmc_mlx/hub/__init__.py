"""Hugging Face Hub I/O: downloading sources, publishing artifacts with a model card."""
