"""Train a tiny Llama with FSDP2 on N CPU ranks, checkpointing with ckptools.CheckpointManager.

Run: ``python examples/train_fsdp2.py RUN_DIR --world-size 4 --steps 3 [--logits OUT.pt]``

Each rank is a real process (gloo backend); the model is ``transformers``' LlamaForCausalLM with a
small config, sharded with ``fully_shard`` per decoder layer and at the root. Every step is saved
with ``CheckpointManager`` (atomic ``RUN_DIR/step-N/``, keep the last 2, checksums, the model's
``config.json``); a second run with a larger ``--steps`` resumes from the newest checkpoint.
``--logits`` writes the final model's logits on a fixed input, to compare with what
``transformers`` computes from the consolidated model.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# transformers imports torchao whenever it is installed (a dev extra of this project), and that
# import logs a warning for each GPU kernel a CPU machine cannot load: not this demo's to show
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

VOCAB = 251  # odd sizes: shards of uneven length on 4 ranks


def tiny_llama_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def probe_input() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(99))


def _worker(
    rank: int, world_size: int, run: str, steps: int, logits: str | None, init_file: str
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    import ckptools

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = ckptools.CheckpointManager(run, keep_last=2)
    restored = manager.restore(model, optim)
    start = restored[0] if restored else 0
    if rank == 0 and restored:
        print(f"resumed from {manager.latest()} (step {start})", flush=True)
    data = torch.randint(0, VOCAB, (100, 8, 16), generator=torch.Generator().manual_seed(1234))
    per = 8 // world_size
    for step in range(start, steps):
        ids = data[step, rank * per : (rank + 1) * per]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        manager.save(step + 1, model, optim, extra={"step": step + 1},
                     metrics={"loss": loss.item()})  # fmt: skip
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f} -> {manager.latest()}", flush=True)
    manager.close()
    if logits:
        with torch.no_grad():
            out = model(input_ids=probe_input()).logits
        if rank == 0:
            torch.save(out, logits)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--logits", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(
            _worker,
            args=(args.world_size, args.run, args.steps, args.logits, init_file),
            nprocs=args.world_size,
            join=True,
        )


if __name__ == "__main__":
    main()
