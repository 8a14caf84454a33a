"""Writing in the background: the background writer process and the shared-memory arena tensors are staged in."""
