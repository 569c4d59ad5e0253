"""``ckpt reshard`` and ``ckpt shard``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ckptools.cli import options as shared
from ckptools.cli.render import emit, human_bytes, plural, shortlist, summary
from ckptools.producers.registry import WRITE_TARGETS, write_targets

_WORLD_SIZE_HELP = "Ranks of the target layout."
#: ``shard --to``: ckptools' own DCP, then what each producer's writer makes
_TO_HELP = "; ".join(
    ("dcp: what dcp.load into the model reads", *shared.producers_say("shard --to"))
)
#: ``shard --to NAME`` of a producer's writer needs no world size (it says what it means there)
_SHARD_WORLD_SIZE_HELP = (
    "Ranks of the target layout (required for --to dcp; "
    f"{'; '.join(shared.producers_say('shard --world-size'))})."
)

#: what both commands take, in the order --help lists them: they write the same DCP layout the
#: same way
_SHARED = (
    click.argument("src", type=click.Path()),
    click.argument("out", type=click.Path()),
    shared.overwrite_option,
    shared.dry_run_option(),
    shared.workers_option,
    shared.quiet_option,
    shared.format_option,
    shared.tag_option,
    shared.json_option,
    shared.storage_options_option,
)  # fmt: skip


def _common(required: bool = True) -> Callable[[shared.F], shared.F]:
    def decorate(f: shared.F) -> shared.F:
        world_size = click.option(
            "--world-size", type=click.IntRange(min=1), required=required,
            help=_WORLD_SIZE_HELP if required else _SHARD_WORLD_SIZE_HELP,
        )  # fmt: skip
        for option in reversed((*_SHARED[:2], world_size, *_SHARED[2:])):
            f = option(f)
        return f

    return decorate


@click.command("reshard")
@_common()
@click.option(
    "--rank-state",
    type=click.Choice(["keep", "drop"]),
    default="keep",
    show_default=True,
    help="Per-rank state that cannot be split (RNG files, per-rank dataloader entries): carry "
    "it over unchanged, or leave it out. Either way it is reported.",
)
@click.option(
    "--param-order",
    type=click.File("r"),
    default=None,
    help="For a torch.save optimizer keyed by integer ids that does not say which parameter "
    "each is: a file of the parameters' FQNs, one per line, in the order the optimizer got them.",
)
@click.option(
    "--drop-optimizer",
    is_flag=True,
    help="Leave a torch.save source's optimizer state out (e.g. one rank's FSDP1 flat shard).",
)
@click.option(
    "--config",
    type=click.Path(),
    default=None,
    help="The model's config.json (file or directory; default: the checkpoint's own): for an "
    "optimizer keyed by integer ids beside a model.safetensors (accelerate's save_state) or in "
    "a Trainer's two groups, the model it builds gives their order.",
)
def reshard_command(
    src: str,
    out: str,
    quiet: bool,
    as_json: bool,
    param_order: Any,
    tag: str | None,
    **options: Any,
) -> None:
    """Rewrite the training checkpoint SRC as if FSDP2 on --world-size ranks had saved it.

    Model, optimizer state and every other entry; each tensor split on dim 0 as fully_shard
    splits it, rank r's pieces in __r_0.distcp, so each rank loads exactly its own file, and
    its optimizer state keyed by FQN as get_state_dict keys it, so an FSDP2 job resumes with
    set_state_dict. SRC is any training checkpoint ckptools reads: a DCP directory, the outer
    directory of accelerate / Trainer / Lightning / torchtitan / verl / DeepSpeed checkpoints,
    a transformers distributed save, or a torch.save training checkpoint (model and optimizer
    state dicts).

    \b
    Examples:
      ckpt reshard ckpt/step-1000 ckpt-16/step-1000 --world-size 16
      ckpt reshard output_dir/checkpoint-500 ckpt-8 --world-size 8
      ckpt reshard ds_run ckpt-8 --world-size 8 --tag global_step100
      ckpt reshard checkpoints/global_step_100 ckpt-4 --world-size 4 --dry-run
      ckpt reshard checkpoint.pt ckpt-4 --world-size 4
      torchrun --nproc-per-node 4 -m ckptools reshard ckpt/step-1000 ckpt-16 --world-size 16
    """
    from ckptools.engine.collective import plans_elsewhere

    if plans_elsewhere(options["dry_run"]):
        return
    from ckptools.verbs.reshard import reshard

    order = None
    if param_order is not None:
        order = [line.strip() for line in param_order if line.strip()]
    src = shared.at_tag(src, tag)
    result = reshard(src, out, quiet=quiet or as_json, param_order=order, **options)
    emit(result, as_json, _render)


@click.command("shard")
@_common(required=False)
@click.option(
    "--prefix",
    default="model.",
    show_default=True,
    help="Key prefix of every tensor (model. is what dcp.save({'model': sd}) writes).",
)
@click.option(
    "--config",
    type=click.Path(),
    default=None,
    help="The model's config.json (default: beside SRC): names the transformers conversion.",
)
@click.option(
    "--keep-stored-names",
    is_flag=True,
    default=False,
    help="Keep SRC's names and shapes instead of the in-memory layout transformers loads into "
    "(e.g. per-expert MoE tensors fused).",
)
@click.option(
    "--to",
    type=click.Choice(write_targets()),
    default="dcp",
    show_default=True,
    help=_TO_HELP,
)
@click.option(
    "--make-vocab-size-divisible-by",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help=" ".join(shared.producers_say("shard --make-vocab-size-divisible-by")),
)
@shared.filled(examples=shared.examples("shard examples"))
def shard_command(
    src: str, out: str, quiet: bool, as_json: bool, tag: str | None, **options: Any
) -> None:
    """Make a DCP checkpoint for --world-size ranks from a full model at SRC.

    SRC is a Hugging Face safetensors directory or file, or a torch.save state dict.

    \b
    Examples:
      ckpt shard ./Llama-3-8B ckpt/step-0 --world-size 8{examples}
    """
    from ckptools.engine.collective import plans_elsewhere

    if plans_elsewhere(options["dry_run"]):
        return
    from ckptools.verbs.reshard import shard

    if options["world_size"] is None:
        if options["to"] not in WRITE_TARGETS:  # a producer's writer takes 1 by default
            raise click.MissingParameter(param_type="option", param_hint="'--world-size'")
        options["world_size"] = 1
    src = shared.at_tag(src, tag)
    emit(shard(src, out, quiet=quiet or as_json, **options), as_json, _render)


def _render(d: dict[str, Any]) -> str:
    """The shape ``consolidate`` prints: SRC -> OUT, notes, what is (or would be) written,
    and the one summary line."""
    lines = [f"{d['src']} -> {d['out']}"]
    lines.extend(f"  note: {note}" for note in d["notes"])
    verb = "would write" if d["dry_run"] else "wrote"
    for sub, part in d["parts"].items():
        where = f"{d['out']}/{sub}" if sub else d["out"]
        lines.append(
            f"  {verb}: {where}: {plural(part['tensors'], 'tensor')} in "
            f"{plural(part['chunks'], 'chunk')}, {plural(part['objects'], 'object')}, "
            f"{plural(d['world_size'], 'rank file')}"
        )
        if d["dry_run"]:
            lines.extend(
                f"    {f['file']}  {human_bytes(f['bytes'])}  "
                f"{plural(f['tensors'], 'chunk')}, {plural(f['objects'], 'object')}"
                for f in part["files"]
            )
    copied = d["copied_files"]
    if copied:
        lines.append(f"  copied beside the data: {shortlist(copied)}")
    tensors = sum(p["tensors"] for p in d["parts"].values())
    total = sum(p["bytes"] for p in d["parts"].values())
    lines.append(summary(tensors, total, None if d["dry_run"] else d["seconds"]))
    return "\n".join(lines)
