"""Pure planners: from manifests to frozen plans of which source byte ranges go where.

No disk, no process group, no torch: :mod:`~ckptools.plan.safetensors` plans a Hugging Face
model directory (consolidate, save_pretrained), :mod:`~ckptools.plan.dcp` an FSDP2 layout for N
ranks (reshard, shard). The engine (:mod:`ckptools.engine`) executes them.
"""
