"""Checkpoint file formats: writers and readers, independent of how tensors are gathered."""
