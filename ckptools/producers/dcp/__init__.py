"""DCP and its wrappers: torch.distributed.checkpoint directories (FSDP1/FSDP2/HSDP/TP),
accelerate, the Trainer, Lightning and torchtitan saves, per-rank metadata without a global
one, and ckptools' own CheckpointManager saves."""
