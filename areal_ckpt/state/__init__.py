"""Training state that is not model weights: RNG streams and pickle-free serialization."""
