"""``ckpt verify``, ``ckpt diff`` and ``ckpt checksum``."""

from __future__ import annotations

from typing import Any

import click

from ckptools.cli.options import FORMAT_NAMES, format_option, json_option, storage_options_option
from ckptools.cli.render import dumps, human_bytes, table

_DIFF_LIMIT = 50  # differing tensors shown in the table without --all


def _tolerances(f: Any) -> Any:
    f = click.option(
        "--rtol", type=float, default=None, help="Relative tolerance (default: bit-exact)."
    )(f)
    return click.option(
        "--atol", type=float, default=None, help="Absolute tolerance (default: bit-exact)."
    )(f)


@click.command("verify")
@click.argument("path", type=click.Path())
@click.option("--quick", is_flag=True, help="Structure only: metadata and file sizes (seconds).")
@click.option("--check-finite", is_flag=True, help="Report NaN/Inf values per tensor.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Files read in parallel.")
@click.option(
    "--against", type=click.Path(), default=None, help="Also compare the model with this one."
)
@_tolerances
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@format_option
@json_option
@click.pass_context
@storage_options_option
def verify_command(
    ctx: click.Context,
    path: str,
    quick: bool,
    check_finite: bool,
    workers: int | None,
    against: str | None,
    atol: float | None,
    rtol: float | None,
    quiet: bool,
    format: str | None,
    as_json: bool,
    storage_options: str | None,
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
    from ckptools.cli.main import EXIT_DIFFERENCES
    from ckptools.collective import reports_here
    from ckptools.verify import verify

    report = verify(
        path,
        quick=quick,
        check_finite=check_finite,
        workers=workers,
        against=against,
        atol=atol,
        rtol=rtol,
        format=format,
        quiet=quiet or as_json,
        distributed=True,
        storage_options=storage_options,
    )
    if reports_here():  # under torchrun every rank has the same report; rank 0 prints it
        data = report.to_dict()
        click.echo(dumps(data) if as_json else _render_verify(data))
    if not report.ok:
        ctx.exit(EXIT_DIFFERENCES)


def _render_verify(d: dict[str, Any]) -> str:
    lines = []
    what = f"{d['format']}, {d['layout']}" if d["format"] else "unreadable"
    lines.append(f"{d['path']} ({what})")
    level = "structure" if d["quick"] else "structure + content"
    if d["check_finite"]:
        level += " + finite values"
    lines.append(
        f"  checked {level}: {d['tensors']} tensors, {d['chunks']} chunks, {d['files']} files; "
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
@_tolerances
@click.option("--format-a", type=click.Choice(FORMAT_NAMES), default=None, help="Layout of A.")
@click.option("--format-b", type=click.Choice(FORMAT_NAMES), default=None, help="Layout of B.")
@click.option("--all", "show_all", is_flag=True, help="List equal tensors too.")
@json_option
@click.pass_context
@storage_options_option
def diff_command(
    ctx: click.Context,
    a: str,
    b: str,
    atol: float | None,
    rtol: float | None,
    format_a: str | None,
    format_b: str | None,
    show_all: bool,
    as_json: bool,
    storage_options: str | None,
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
    from ckptools.cli.main import EXIT_DIFFERENCES
    from ckptools.diff import diff

    report = diff(
        a,
        b,
        atol=atol,
        rtol=rtol,
        format_a=format_a,
        format_b=format_b,
        storage_options=storage_options,
    )
    data = report.to_dict()
    click.echo(dumps(data) if as_json else _render_diff(data, show_all))
    if not report.identical:
        ctx.exit(EXIT_DIFFERENCES)


def _render_diff(d: dict[str, Any], show_all: bool) -> str:
    from ckptools.diff import TensorDiff

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
        rows = []
        for t in shown:
            detail = TensorDiff(
                t["name"],
                t["status"],
                t["fqn_a"],
                t["fqn_b"],
                t["dtype_a"],
                t["dtype_b"],
                tuple(t["shape_a"]) if t["shape_a"] is not None else None,
                tuple(t["shape_b"]) if t["shape_b"] is not None else None,
                t["mismatched"],
                _num(t["max_abs"]),
                _num(t["max_rel"]),
                tuple(t["first_index"]) if t["first_index"] is not None else None,
                t["value_a"],
                t["value_b"],
            ).describe()
            rows.append([t["name"], t["status"], detail.split(": ", 1)[1]])
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


def _num(x: Any) -> float | None:
    return None if x is None else float(x)


@click.command("checksum")
@click.argument("path", type=click.Path())
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Files read in parallel.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@format_option
@json_option
@storage_options_option
def checksum_command(
    path: str,
    workers: int | None,
    quiet: bool,
    format: str | None,
    as_json: bool,
    storage_options: str | None,
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
    from ckptools.collective import reports_here
    from ckptools.verify.checksums import write_checksums

    sums = write_checksums(
        path,
        format=format,
        workers=workers,
        quiet=quiet or as_json,
        distributed=True,
        storage_options=storage_options,
    )
    if not reports_here():
        return  # under torchrun every rank hashed its share; rank 0 reports
    data = {"path": path, "checksum_file": sums.path, "chunks": len(sums.items),
            "files": len(sums.files), "algorithm": sums.algorithm}  # fmt: skip
    if as_json:
        click.echo(dumps(data))
    else:
        click.echo(
            f"{path}: wrote {sums.path} ({sums.algorithm}: {len(sums.items)} items, "
            f"{len(sums.files)} files)"
        )
