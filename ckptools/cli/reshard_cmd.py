"""``ckpt reshard`` and ``ckpt shard``."""

from __future__ import annotations

from typing import Any

import click

from ckptools.cli.options import format_option, json_option, storage_options_option
from ckptools.cli.render import dumps, human_bytes


def _common(f: Any) -> Any:
    f = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")(f)
    f = click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True,
                     help="Copy threads (pieces are written in parallel).")(f)  # fmt: skip
    f = click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")(f)
    f = click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")(f)
    f = click.option("--world-size", type=click.IntRange(min=1), required=True,
                     help="Ranks of the target layout.")(f)  # fmt: skip
    return json_option(format_option(f))


@click.command("reshard")
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@_common
@click.option(
    "--rank-state",
    type=click.Choice(["keep", "drop"]),
    default="keep",
    show_default=True,
    help="Per-rank state that cannot be split (RNG files, per-rank dataloader entries): carry "
    "it over unchanged, or leave it out. Either way it is reported.",
)
@storage_options_option
def reshard_command(
    src: str,
    out: str,
    world_size: int,
    overwrite: bool,
    dry_run: bool,
    workers: int,
    quiet: bool,
    as_json: bool,
    format: str | None,
    rank_state: str,
    storage_options: str | None,
) -> None:
    """Rewrite the DCP checkpoint SRC as if FSDP2 on --world-size ranks had saved it.

    Model, optimizer state and every other entry; each tensor split on dim 0 as fully_shard
    splits it, rank r's pieces in __r_0.distcp, so each rank loads exactly its own file. SRC may
    be the outer directory of accelerate / Trainer / Lightning / torchtitan checkpoints.

    \b
    Examples:
      ckpt reshard ckpt/step-1000 ckpt-16/step-1000 --world-size 16
      torchrun --nproc-per-node 4 -m ckptools reshard ckpt/step-1000 ckpt-16/step-1000 \
          --world-size 16
    """
    from ckptools.reshard import reshard

    result = reshard(
        src, out, world_size=world_size, rank_state=rank_state,  # type: ignore[arg-type]
        overwrite=overwrite, dry_run=dry_run, workers=workers, quiet=quiet or as_json,
        format=format,
        storage_options=storage_options,
    )  # fmt: skip
    _render(result.to_dict(), as_json)


@click.command("shard")
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@_common
@click.option(
    "--prefix",
    default="model.",
    show_default=True,
    help="Key prefix of every tensor (model. is what dcp.save({'model': sd}) writes).",
)
@storage_options_option
def shard_command(
    src: str,
    out: str,
    world_size: int,
    overwrite: bool,
    dry_run: bool,
    workers: int,
    quiet: bool,
    as_json: bool,
    format: str | None,
    prefix: str,
    storage_options: str | None,
) -> None:
    """Make a DCP checkpoint for --world-size ranks from a full model at SRC.

    SRC is a Hugging Face safetensors directory or file, or a torch.save state dict.

    \b
    Example:
      ckpt shard ./Llama-3-8B ckpt/step-0 --world-size 8
    """
    from ckptools.reshard import shard

    result = shard(
        src, out, world_size=world_size, prefix=prefix, overwrite=overwrite, dry_run=dry_run,
        workers=workers, quiet=quiet or as_json, format=format,
        storage_options=storage_options,
    )  # fmt: skip
    _render(result.to_dict(), as_json)


def _render(d: dict[str, Any], as_json: bool) -> None:
    from ckptools.collective import reports_here

    if not reports_here():
        return  # under torchrun every rank wrote its files; rank 0 reports
    if as_json:
        click.echo(dumps(d))
        return
    verb = "would write" if d["dry_run"] else "wrote"
    for sub, part in d["parts"].items():
        where = f"{d['out']}/{sub}" if sub else d["out"]
        click.echo(
            f"{where}: {part['tensors']} tensors in {part['chunks']} chunks, "
            f"{part['objects']} objects, {d['world_size']} rank files"
        )
        if d["dry_run"]:
            for f in part["files"]:
                click.echo(
                    f"  {f['file']}  {human_bytes(f['bytes'])}  "
                    f"{f['tensors']} chunks, {f['objects']} objects"
                )
    for note in d["notes"]:
        click.echo(f"note: {note}")
    total = sum(p["bytes"] for p in d["parts"].values())
    secs = d["seconds"]
    rate = f", {total / secs / 1e9:.2f} GB/s" if secs and not d["dry_run"] else ""
    click.echo(f"{verb} {human_bytes(total)} in {secs:.2f} s{rate}")
