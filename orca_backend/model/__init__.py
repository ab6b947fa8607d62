"""Model families with selective batching, checkpoints, and sharded loading."""
