"""Hugging Face safetensors model directories, transformers' distributed (per-rank) safetensors,
and torch.save files (state dicts, Lightning's .ckpt, training checkpoints)."""
