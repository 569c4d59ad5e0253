"""``ckpt inspect``."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import click

from ckptools.cli.options import (
    at_tag,
    format_option,
    json_option,
    storage_options_option,
    tag_option,
)
from ckptools.cli.render import emit, human_bytes, human_count, plural, table
from ckptools.producers.registry import inspected


@click.command("inspect")
@click.argument("path", type=click.Path())
@json_option
@format_option
@tag_option
@click.option(
    "--values", is_flag=True, help="Decode non-tensor entries too (through the safe allowlist)."
)
@click.option("--limit", type=int, default=None, help="Show at most N tensors in the table.")
@click.option(
    "--key",
    default=None,
    metavar="NAME",
    help="The container holding the model's state dict (e.g. model_state_dict, app.model); "
    "default: found from the keys.",
)
@storage_options_option
def inspect_command(
    path: str, as_json: bool, limit: int | None, tag: str | None, **options: Any
) -> None:
    """Show what the checkpoint at PATH holds: tensors, dtypes, shapes, bytes, chunks, ranks.

    Reads metadata only; never runs code stored in the checkpoint.

    \b
    Examples:
      ckpt inspect checkpoints/step-1000
      ckpt inspect out/checkpoint-500 --json | jq '.totals'
      ckpt inspect checkpoint.pth --key model_state_dict
    """
    from ckptools.verbs.inspection import inspect

    emit(inspect(at_tag(path, tag), **options), as_json, partial(_render, limit=limit))


def _optimizer_line(opt: dict[str, Any]) -> str:
    elements = ", ".join(f"{k} {human_count(v)}" for k, v in opt["elements"].items())
    names = "with param_names" if opt["param_names"] else "without param_names"
    return (
        f"optimizer {opt['key']!r}: {opt['keyed']}-keyed, {opt['entries']} entries "
        f"({', '.join(opt['state']) or 'no state'}; elements: {elements or '-'}), "
        f"{opt['param_groups']} param group(s) listing {opt['params']} params {names}; "
        f"hyper-parameters: {', '.join(opt['hyperparameters']) or '-'}"
    )


def _mesh_line(d: dict[str, Any]) -> list[str]:
    """The mesh a per-rank checkpoint was sharded on, and its placements."""
    mesh = d.get("mesh")
    if not mesh:
        return []
    shape = " x ".join(str(n) for n in mesh["shape"]) if mesh["shape"] else "?"
    placed = ", ".join(f"{k} {v}" for k, v in mesh["placements"].items())
    return [f"  mesh: {shape}" + (f"; placements: {placed} tensors" if placed else "")]


def _idle_ranks(d: dict[str, Any]) -> list[str]:
    """Ranks with files but no chunk read from them."""
    per_rank = d["totals"]["bytes_per_rank"]
    idle = sorted(
        {f["rank"] for f in d["files"] if f["rank"] is not None} - {int(r) for r in per_rank}
    )
    if not per_rank or not idle:
        return []
    return [
        f"  ranks {', '.join(map(str, idle[:16]))}{' ...' if len(idle) > 16 else ''}: no tensor "
        "bytes read from their files (HSDP replicas, say, repeat other ranks' shards)"
    ]


def _render(d: dict[str, Any], limit: int | None) -> str:
    out = []
    ws = d["world_size"]
    out.append(f"{d['path']}")
    out.append(
        f"  format: {d['format']}   layout: {d['layout']}"
        + (f"   world size: {ws}" if ws is not None else "")
    )
    for note in d["notes"]:
        out.append(f"  note: {note}")
    mp = d["model_part"]
    excluded = f" (excluding {', '.join(mp['excluded'])})" if mp["excluded"] else ""
    listed = not d["tensors"] and not d["objects"] and any(d.get(p.KEY) for p in inspected())
    if not listed:  # listed by its producer's facts alone: it has no model part of ours
        out.append(
            f"  model part: prefix {mp['prefix']!r}{excluded}, {mp['tensors']} tensors, "
            f"{human_count(mp['elements'])} elements"
        )
    for src in d["sources"]:
        under = f" (under {src['under']!r})" if src["under"] else ""
        out.append(f"  {src['role']} file: {src['file']}{under}, keys: {', '.join(src['keys'])}")
    if d["step"] is not None:
        out.append(f"  step: {d['step']}")
    for producer in inspected():  # a producer's own facts, in its own words
        if d.get(producer.KEY):
            out.extend(producer.lines(d[producer.KEY]))
    for opt in d["optimizers"]:
        out.append("  " + _optimizer_line(opt))
    if d.get("peft"):
        out.extend(_peft_lines(d["peft"]))
    if d["sharding"]:
        out.append("  sharding: " + ", ".join(f"{k}: {v}" for k, v in d["sharding"].items()))
    for enc in d.get("encodings", ()):
        unread = " (decoded when read)" if enc["decoded"] else f" ({enc['missing']})"
        out.append(
            f"  encoding: {enc['items']} item(s) stored with the DCP transform "
            f"{' + '.join(enc['transforms'])}{unread}"
        )
    out.extend(_mesh_line(d))
    if listed:
        return "\n".join(out)  # no tables, no totals
    out.append("")
    tensors = d["tensors"] if limit is None else d["tensors"][:limit]
    rows = [
        [
            t["fqn"],
            t["dtype"],
            "[" + ", ".join(str(s) for s in t["shape"]) + "]",
            human_bytes(t["bytes"]),
            str(t["chunks"]),
        ]
        for t in tensors
    ]
    out.append(table(["tensor", "dtype", "shape", "bytes", "chunks"], rows, "lllrr"))
    if limit is not None and len(d["tensors"]) > limit:
        out.append(f"... {len(d['tensors']) - limit} more tensors (use --limit or --json)")
    if d["objects"]:
        out.append("")
        orows = []
        for o in d["objects"]:
            value = o.get("value")
            shown = "" if "value" not in o else json.dumps(value, default=str)
            if len(shown) > 60:
                shown = shown[:57] + "..."
            orows.append([o["fqn"], human_bytes(o.get("bytes")), shown])
        out.append(table(["object", "bytes", "value"], orows, "lrl"))
    tot = d["totals"]
    out.append("")
    shared = []
    if tot.get("tied_aliases"):
        shared.append(f"{plural(len(tot['tied_aliases']), 'tied weight name')}")
    if tot.get("shared_aliases"):
        shared.append(f"{plural(len(tot['shared_aliases']), 'other entry', 'other entries')}")
    out.append(
        f"  {plural(tot['tensors'], 'tensor')}, {plural(tot['objects'], 'object')}, "
        f"{human_count(tot['parameters'])} parameters, {human_bytes(tot['bytes'])}"
        + (f" ({' and '.join(shared)} sharing another's bytes, counted once)" if shared else "")
    )
    out.append(
        "  by dtype: "
        + ", ".join(f"{k} {human_bytes(v)}" for k, v in tot["bytes_per_dtype"].items())
    )
    if tot["bytes_per_rank"]:
        per_rank = tot["bytes_per_rank"]
        chunks = tot["chunks_per_rank"]
        first = list(per_rank.items())[:16]
        out.append(
            "  by rank: "
            + ", ".join(f"{r}: {human_bytes(b)} ({chunks.get(r, 0)} chunks)" for r, b in first)
            + (f", ... ({len(per_rank)} ranks)" if len(per_rank) > 16 else "")
        )
        out.extend(_idle_ranks(d))
    return "\n".join(out)


def _peft_lines(peft: dict[str, Any]) -> list[str]:
    """``inspect``'s lines for a PEFT-wrapped model (:func:`ckptools.views.lora.describe`)."""
    out = []
    for name, a in peft["adapters"].items():
        out.append(
            f"  LoRA adapter {name!r}: {a['modules']} modules, target modules "
            f"{', '.join(a['target_modules'])}, rank {'/'.join(str(r) for r in a['ranks'])}"
        )
    state = (
        f"{len(peft['with_optimizer_state'])} with optimizer state"
        if peft["optimizer_state_found"]
        else "no optimizer state in the checkpoint"
    )
    out.append(
        f"  PEFT: {peft['trainable_parameters']} trainable parameters ({state}), "
        f"{peft['frozen_parameters']} frozen ({human_bytes(peft['frozen_bytes'])})"
    )
    return out
