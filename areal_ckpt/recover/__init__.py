"""Recovery checkpoints: the RecoverHandler (dump / load), the reading and writing of a generation, and the store that commits generations."""
