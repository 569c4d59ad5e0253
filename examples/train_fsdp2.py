"""Train a tiny Llama with FSDP2 on N CPU ranks and save a sharded DCP checkpoint.

Run: ``python examples/train_fsdp2.py OUT_DIR --world-size 4 --steps 3``

Each rank is a real process (gloo backend); the model is ``transformers``' LlamaForCausalLM with a
small config, sharded with ``fully_shard`` per decoder layer and at the root. The checkpoint is
written by ``torch.distributed.checkpoint.save`` as ``{"model": ..., "optim": ...}`` with FQN-keyed
optimizer state, plus the model's ``config.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def tiny_llama_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=251,  # odd sizes: shards of uneven length on 4 ranks
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _worker(rank: int, world_size: int, out: str, steps: int, init_file: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    torch.manual_seed(0)
    config = tiny_llama_config()
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + rank)
    for step in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": steps}, checkpoint_id=out)
    if rank == 0:
        config.save_pretrained(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(
            _worker,
            args=(args.world_size, args.out, args.steps, init_file),
            nprocs=args.world_size,
            join=True,
        )
    print(f"saved FSDP2 checkpoint ({args.world_size} ranks) to {args.out}")


if __name__ == "__main__":
    main()
