"""Running work beside the training loop: the background writer process, the shared-memory arena
tensors are staged in, and the one retry policy every write follows."""
