"""Many sequences at once: the batched engine, its padded cache, and batched drafters (used by the server and
training data)."""
