"""Megatron-core torch_dist checkpoints: the run directory and its iter_*/ saves, the
distributed optimizer's buckets, the GPT <-> Hugging Face mapping (plan), and a save read as
the HF model's training checkpoint (training)."""
