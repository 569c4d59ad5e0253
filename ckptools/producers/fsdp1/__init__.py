"""FSDP1 flat parameters (FlatParameter shards found and unflattened) and verl's per-rank
FSDP checkpoints."""
