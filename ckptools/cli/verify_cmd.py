"""``ckpt verify``, ``ckpt diff`` and ``ckpt checksum``."""

from __future__ import annotations

from functools import partial
from typing import Any

import click

from ckptools.cli.exit_codes import EXIT_DIFFERENCES
from ckptools.cli.options import (
    FORMAT_NAMES,
    at_tag,
    format_option,
    json_option,
    quiet_option,
    storage_options_option,
    tag_option,
    tolerance_options,
    workers_option,
)
from ckptools.cli.render import emit, human_bytes, plural, table

_DIFF_LIMIT = 50  # differing tensors shown in the table without --all


@click.command("verify")
@click.argument("path", type=click.Path())
@click.option("--quick", is_flag=True, help="Structure only: metadata and file sizes (seconds).")
@click.option("--check-finite", is_flag=True, help="Report NaN/Inf values per tensor.")
@workers_option
@click.option(
    "--against", type=click.Path(), default=None, help="Also compare the model with this one."
)
@tolerance_options
@quiet_option
@format_option
@tag_option
@json_option
@click.pass_context
@storage_options_option
def verify_command(
    ctx: click.Context, /, path: str, quiet: bool, as_json: bool, tag: str | None, **options: Any
) -> None:
    """Check that the checkpoint at PATH is whole; name every problem (file, FQN, rank).

    Structure (files present and long enough, chunks tile every tensor, commit marker), then
    content: every chunk read once, its torch.save CRC-32s checked, and the checksum manifest
    (`ckpt checksum`) when present. Exit 0 when clean, 3 when problems or differences were found.

    \b
    Examples:
      ckpt verify checkpoints/step-1000
      ckpt verify checkpoints/step-1000 --quick
      ckpt verify checkpoints/step-1000 --check-finite --json
      ckpt verify checkpoints/step-1000 --against hf_model
      torchrun --nproc-per-node 4 -m ckptools verify checkpoints/step-1000
    """
    from ckptools.verify import verify

    report = verify(at_tag(path, tag), quiet=quiet or as_json, distributed=True, **options)
    emit(report, as_json, _render_verify)
    if not report.ok:  # on every rank: each has the same report
        ctx.exit(EXIT_DIFFERENCES)


def _render_verify(d: dict[str, Any]) -> str:
    lines = []
    what = f"{d['format']}, {d['layout']}" if d["format"] else "unreadable"
    lines.append(f"{d['path']} ({what})")
    level = "structure" if d["quick"] else "structure + content"
    if d["check_finite"]:
        level += " + finite values"
    lines.append(
        f"  checked {level}: {plural(d['tensors'], 'tensor')}, {plural(d['chunks'], 'chunk')}, "
        f"{plural(d['files'], 'file')}; "
        f"read {human_bytes(d['bytes_read'])} in {d['seconds']:.2f} s"
    )
    if d["checksums_checked"]:
        lines.append(f"  checksums: checked against {d['checksum_file']}")
    elif not d["quick"] and d["format"]:
        lines.append("  checksums: none (write them with `ckpt checksum PATH`)")
    findings = d["findings"]
    if findings:
        lines.append(f"  {len(findings)} problem(s):")
        lines.extend(f"  [{f['kind']}] {f['message']}" for f in findings)
    else:
        lines.append("  OK: no problems found")
    if d["diff"] is not None:
        lines.append("")
        lines.append(_render_diff(d["diff"], show_all=False))
    return "\n".join(lines)


@click.command("diff")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@tolerance_options
@click.option("--format-a", type=click.Choice(FORMAT_NAMES), default=None, help="Layout of A.")
@click.option("--format-b", type=click.Choice(FORMAT_NAMES), default=None, help="Layout of B.")
@click.option("--tag-a", default=None, metavar="TAG", help="The save TAG inside A (as --tag).")
@click.option("--tag-b", default=None, metavar="TAG", help="The save TAG inside B (as --tag).")
@click.option("--all", "show_all", is_flag=True, help="List equal tensors too.")
@click.option(
    "--config",
    type=click.Path(),
    default=None,
    help="The model's config.json (default: beside each side): names the transformers "
    "conversion; both sides are compared in save_pretrained's on-disk format.",
)
@click.option(
    "--keep-in-memory-names",
    is_flag=True,
    default=False,
    help="Compare in the in-memory form (e.g. fused MoE experts) instead.",
)
@json_option
@click.pass_context
@storage_options_option
def diff_command(
    ctx: click.Context,
    /,
    a: str,
    b: str,
    show_all: bool,
    as_json: bool,
    tag_a: str | None,
    tag_b: str | None,
    **options: Any,
) -> None:
    """Compare the models in checkpoints A and B (any formats), tensor by tensor.

    Names are the model's own FQNs (as `ckpt consolidate` writes them), so a DCP checkpoint
    compares with its safetensors consolidation. Reports missing/unexpected tensors, dtype and
    shape differences, and values: bit-exact, or within --atol/--rtol with the max absolute and
    relative difference. Exit 0 when identical, 3 when they differ.

    \b
    Examples:
      ckpt diff checkpoints/step-1000 hf_model
      ckpt diff run1/step-100 run2/step-100 --atol 1e-6 --json
    """
    from ckptools.verbs.diff import diff

    report = diff(at_tag(a, tag_a), at_tag(b, tag_b), **options)
    emit(report, as_json, partial(_render_diff, show_all=show_all))
    if not report.identical:
        ctx.exit(EXIT_DIFFERENCES)


def _render_diff(d: dict[str, Any], show_all: bool) -> str:
    lines = [f"diff {d['a']} ({d['format_a']}) vs {d['b']} ({d['format_b']})"]
    lines.extend(f"  note: {n}" for n in d["notes"])
    tensors = d["tensors"]
    shown = tensors if show_all else [t for t in tensors if t["status"] not in ("equal", "close")]
    if not show_all and len(shown) > _DIFF_LIMIT:
        hidden = len(shown) - _DIFF_LIMIT
        shown = shown[:_DIFF_LIMIT]
    else:
        hidden = 0
    if shown:
        rows = [[t["name"], t["status"], _detail(t)] for t in shown]
        lines.append(table(["tensor", "status", "detail"], rows, "lll"))
    if hidden:
        lines.append(f"... {hidden} more differing tensors (use --all or --json)")
    counts = ", ".join(f"{k}: {v}" for k, v in d["counts"].items())
    verdict = "identical" if d["identical"] else "DIFFERENT"
    lines.append(
        f"  {verdict}: {len(tensors)} tensors ({counts}); compared "
        f"{human_bytes(d['bytes_compared'])} in {d['seconds']:.2f} s"
    )
    return "\n".join(lines)


def _detail(t: dict[str, Any]) -> str:
    """What differs in one tensor of a diff's JSON form, as :meth:`TensorDiff.describe` says it
    (less the name, which has its own column)."""
    from ckptools.verbs.diff import TensorDiff

    def shape(key: str) -> tuple[int, ...] | None:
        return None if t[key] is None else tuple(t[key])

    def num(key: str) -> float | None:  # JSON writes inf/nan as strings
        return None if t[key] is None else float(t[key])

    restored = {"shape_a": shape("shape_a"), "shape_b": shape("shape_b"),
                "first_index": shape("first_index"), "max_abs": num("max_abs"),
                "max_rel": num("max_rel")}  # fmt: skip
    return TensorDiff(**{**t, **restored}).describe().split(": ", 1)[1]


@click.command("checksum")
@click.argument("path", type=click.Path())
@workers_option
@quiet_option
@format_option
@tag_option
@json_option
@storage_options_option
def checksum_command(
    path: str, quiet: bool, as_json: bool, tag: str | None, **options: Any
) -> None:
    """Write a checksum manifest for the checkpoint at PATH (a hash per chunk and per file).

    `ckpt verify` then checks every chunk's bytes against it, catching what the checkpoint's own
    CRCs cannot (a chunk replaced by another chunk of the same size). The checkpoint is verified
    first; the manifest is written atomically as .ckptools-checksums.json.

    \b
    Examples:
      ckpt checksum checkpoints/step-1000
      torchrun --nproc-per-node 4 -m ckptools checksum checkpoints/step-1000
    """
    from ckptools.verify.checksums import write_checksums

    path = at_tag(path, tag)
    sums = write_checksums(path, quiet=quiet or as_json, distributed=True, **options)
    data = {"path": path, "checksum_file": sums.path, "chunks": len(sums.items),
            "files": len(sums.files), "algorithm": sums.algorithm}  # fmt: skip
    emit(data, as_json, _render_checksum)


def _render_checksum(d: dict[str, Any]) -> str:
    return (
        f"{d['path']}: wrote {d['checksum_file']} ({d['algorithm']}: "
        f"{plural(d['chunks'], 'item')}, {plural(d['files'], 'file')})"
    )
