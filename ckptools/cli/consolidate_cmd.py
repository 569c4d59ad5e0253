"""``ckpt consolidate``."""

from __future__ import annotations

from typing import Any

import click

from ckptools.cli.options import (
    at_tag,
    dry_run_option,
    examples,
    filled,
    format_option,
    json_option,
    overwrite_option,
    producers_say,
    quiet_option,
    storage_options_option,
    tag_option,
    workers_option,
)
from ckptools.cli.render import emit, human_bytes, plural, shortlist, summary, table


@click.command("consolidate")
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="Largest output file, e.g. 5GB, 300KB, 2GiB (KB/GB = 1000s, KiB/GiB = 1024s).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    default=None,
    help=" ".join(
        (
            "Cast floating tensors (only) to this dtype. Default: keep every dtype bit-exactly.",
            *producers_say("consolidate --dtype"),
        )
    ),
)
@click.option(
    "--select",
    default=None,
    help="Export this key sub-tree (e.g. optim, app.model) instead of the model; '*' = all.",
)
@click.option(
    "--key",
    default=None,
    metavar="NAME",
    help="The container holding the model's state dict (e.g. model_state_dict, net); "
    "default: found from the keys. The same as --select NAME.",
)
@click.option("--strip-prefix", default=None, help="Remove this prefix from output names.")
@click.option(
    "--config",
    type=click.Path(),
    default=None,
    help="config.json, or a directory with config and tokenizer files, to copy into OUT. "
    "Default: from the checkpoint directory or its parent (from a numbered save such as "
    "global_step2, up to its run directory's parent). Its config.json must set model_type.",
)
@click.option(
    "--weights-only",
    is_flag=True,
    default=False,
    help="Write the weights alone when no config.json (given, beside SRC or above it) fits "
    "them: OUT then holds model.safetensors only, which from_pretrained cannot load. Without "
    "it that is refused (not needed with --adapter, --select, or a config the producer makes).",
)
@click.option(
    "--keep-in-memory-names",
    is_flag=True,
    default=False,
    help="Write tensors as the model holds them in memory (e.g. fused MoE experts) instead of "
    "the on-disk format save_pretrained writes.",
)
@click.option(
    "--adapter",
    is_flag=True,
    default=False,
    help="PEFT LoRA model: write only the adapter, as PeftModel.save_pretrained does "
    "(adapter_model.safetensors + adapter_config.json); reads only the adapter's bytes.",
)
@click.option(
    "--merge-lora",
    is_flag=True,
    default=False,
    help="PEFT LoRA model: write the model with the adapter merged (W + B@A * alpha/r), "
    "loadable by from_pretrained.",
)
@click.option(
    "--lora-alpha",
    type=float,
    default=None,
    help="The adapter's lora_alpha (checkpoints do not store it); or --adapter-config.",
)
@click.option(
    "--adapter-config",
    type=click.Path(),
    default=None,
    help="An adapter_config.json giving lora_alpha, use_rslora and the rest of the LoraConfig.",
)
@click.option(
    "--adapter-name",
    default=None,
    help="The adapter to export or merge when the model holds several (default: the only one).",
)
@click.option(
    "--masters",
    is_flag=True,
    default=False,
    help=" ".join(producers_say("consolidate --masters")),
)
@overwrite_option
@dry_run_option("Print the plan (files, tensors, sizes); write nothing.")
@workers_option
@quiet_option
@click.option(
    "--push-to-hub",
    metavar="REPO_ID",
    default=None,
    help="Then publish OUT to this Hub repository (as ckpt push OUT REPO_ID --source SRC).",
)
@format_option
@tag_option
@json_option
@storage_options_option
@filled(examples=examples("consolidate examples"))
def consolidate_command(
    src: str,
    out: str,
    push_to_hub: str | None,
    quiet: bool,
    as_json: bool,
    tag: str | None,
    **options: Any,
) -> None:
    """Write the checkpoint at SRC as a Hugging Face safetensors model directory OUT.

    Exports the model part under the model's own FQNs, bit-exactly, streaming (memory stays
    bounded whatever the model size). OUT appears atomically, complete or not at all.

    \b
    Examples:
      ckpt consolidate checkpoints/step-1000 hf_model
      ckpt consolidate out/checkpoint-500 hf_model --max-shard-size 2GB --dtype bfloat16
      ckpt consolidate ckpt hf_model --dry-run
      torchrun --nproc-per-node 4 -m ckptools consolidate ckpt hf_model
      ckpt consolidate checkpoints/step-1000 hf_model --push-to-hub me/my-model
      ckpt consolidate checkpoint.pth hf_model --key model_state_dict
      ckpt consolidate lora-ckpt adapter_dir --adapter --lora-alpha 16
      ckpt consolidate lora-ckpt merged --merge-lora --adapter-config adapter_config.json{examples}
    """
    from ckptools.engine.collective import plans_elsewhere

    if plans_elsewhere(options["dry_run"]):
        return
    from ckptools.verbs.consolidate import consolidate

    src = at_tag(src, tag)

    if push_to_hub is not None:
        from ckptools.cli.push_cmd import check_push_option

        check_push_option(push_to_hub, options["max_shard_size"])
    result = consolidate(src, out, quiet=quiet or as_json, **options)
    if push_to_hub is None:
        emit(result, as_json, _render)
        return
    from ckptools.cli.push_cmd import push_consolidated
    from ckptools.engine.collective import reports_here

    if reports_here():  # under torchrun every rank wrote its share; rank 0 pushes OUT
        push_consolidated(
            result.to_dict(), push_to_hub, as_json=as_json, quiet=quiet, render=_render
        )


def _render(d: dict[str, Any]) -> str:
    lines = []
    verb = "would write" if d["dry_run"] else "wrote"
    lines.append(f"{d['src']} ({d['layout']}) -> {d['out']}")
    for note in d["notes"]:
        lines.append(f"  note: {note}")
    for kept_out, kept in d["dropped_tied"]:
        lines.append(f"  tied: {kept_out} not written (config ties it to {kept})")
    # d["tied"] (written twice, no config ties them) is one of the notes already
    if d["dry_run"]:
        for f in d["plan"]:
            lines.append("")
            count = plural(len(f["tensors"]), "tensor")
            lines.append(f"{f['name']}  {human_bytes(f['bytes'])}, {count}")
            rows = [
                [
                    t["name"],
                    t["dtype"],
                    "[" + ", ".join(map(str, t["shape"])) + "]",
                    human_bytes(t["bytes"]),
                ]
                for t in f["tensors"]
            ]
            lines.append(table(["tensor", "dtype", "shape", "bytes"], rows, "lllr"))
        lines.append("")
    files = shortlist([f["name"] for f in d["files"]])
    if d["index"]:
        files += f" + {d['index']}"
    if d["config_files"]:
        files += f" + {', '.join(d['config_files'])}"
    lines.append(f"  {verb}: {files}")
    total = d["total_size"] if d["dry_run"] else d["bytes_written"]
    skipped = d["skipped_objects"]
    extra = [f"{plural(skipped, 'non-tensor entry', 'non-tensor entries')} not exported"]
    lines.append(
        summary(
            d["tensors"],
            total,
            None if d["dry_run"] else d["seconds"],
            peak_rss_bytes=None if d["dry_run"] else d["peak_rss_bytes"],
            extra=extra if skipped else [],
        )
    )
    return "\n".join(lines)
