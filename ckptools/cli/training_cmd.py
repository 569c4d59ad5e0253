"""``ckpt list`` and ``ckpt prune``: a CheckpointManager root, seen and pruned by hand."""

from __future__ import annotations

import datetime
from typing import Any

import click

from ckptools.cli.options import filled, json_option, producers_say, storage_options_option
from ckptools.cli.render import emit, human_bytes, table


def _metrics_text(metrics: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
    )


def _saves(form: str) -> str:
    """The numbered saves the producers' packages name themselves (``list saves``), each in
    ``form`` (its name, an example save)."""
    return "".join(form.format(*said) for said in producers_say("list saves"))


@click.command("list")
@click.argument("root", type=click.Path())
@json_option
@storage_options_option
@filled(saves=_saves("{} ({}), "))
def list_command(root: str, as_json: bool, storage_options: str | None) -> None:
    """List the saves under ROOT: step, complete or not, size, and which one is latest (what a
    resume or reading ROOT loads). ROOT is a CheckpointManager root (with each save's metrics),
    or a run directory of numbered saves: a Trainer output_dir (checkpoint-N), a DeepSpeed run
    (global_stepN, 'latest'), verl (global_step_N), {saves}torchtitan's or a script's dcp.save
    per step (step-N).

    \b
    Examples:
      ckpt list checkpoints/
      ckpt list output_dir/
      ckpt list checkpoints/ --json | jq '.checkpoints[] | select(.complete) | .step'
    """
    from ckptools.training.store import list_run

    infos = list_run(root, storage_options=storage_options)
    listed: dict[str, Any] = {"root": root, "checkpoints": [c.to_dict() for c in infos]}
    if not infos:
        from ckptools.io.options import storage_options as options_scope
        from ckptools.producers.base import checkpoints_inside
        from ckptools.producers.saves import runs_inside

        with options_scope(storage_options):
            listed["runs_inside"] = runs_inside(root)
            if not listed["runs_inside"]:
                listed["checkpoint_itself"] = _one_save(root)
            if not listed["runs_inside"] and listed["checkpoint_itself"] is None:
                listed["checkpoints_inside"] = [
                    {"name": name, "layout": layout} for name, layout in checkpoints_inside(root)
                ]
    emit(listed, as_json, _render_list)


def _one_save(root: str) -> dict[str, Any] | None:
    """When ROOT is one checkpoint itself (a save, not a run of them): its layout, and the run
    directory above it that lists it (or None): what ``ckpt list`` names instead of "no saves"
    or the parts inside it."""
    from ckptools.errors import CkptError
    from ckptools.io import storage
    from ckptools.producers.base import detect
    from ckptools.training.store import list_run

    try:
        layout = detect(root).name
    except (CkptError, OSError):
        return None
    parent = storage.dirname(root.rstrip("/"))
    name = storage.basename(root.rstrip("/"))
    run = None
    try:
        saves = list_run(parent) if parent and name else []
    except (CkptError, OSError):
        saves = []
    if any((c.name or storage.basename(c.path)) == name for c in saves):
        run = parent
    return {"layout": layout, "run": run}


def _render_list(d: dict[str, Any]) -> str:
    itself = d.get("checkpoint_itself")
    if itself is not None:
        root = d["root"]
        run = f"; `ckpt list {itself['run']}` lists its run" if itself["run"] else ""
        return (
            f"{root}: one {itself['layout']} checkpoint, not a run of saves: "
            f"`ckpt inspect {root}`{run}"
        )
    if not d["checkpoints"] and d.get("runs_inside"):
        inside = d["runs_inside"]
        where = (
            f"{inside[0]} holds saves"
            if len(inside) == 1
            else (f"{len(inside)} directories in it hold saves: {', '.join(inside)}")
        )
        return f"{d['root']}: no saves here; {where}: `ckpt list {inside[0]}`"
    if not d["checkpoints"] and d.get("checkpoints_inside"):
        found = d["checkpoints_inside"]
        shown = ", ".join(f"{c['name']} ({c['layout']})" for c in found[:4])
        more = f", ... ({len(found)} in all)" if len(found) > 4 else ""
        return (
            f"{d['root']}: no numbered saves here; it holds {len(found)} checkpoint(s): "
            f"{shown}{more}: `ckpt inspect {d['root'].rstrip('/')}/{found[0]['name']}`"
        )
    if not d["checkpoints"]:
        return (
            f"{d['root']}: no saves (looked for a CheckpointManager's step-N, Trainer "
            f"checkpoint-N, DeepSpeed global_stepN, verl global_step_N, {_saves('{} {}, ')}"
            "torchtitan's or dcp.save's step-N)"
        )
    rows = []
    for c in d["checkpoints"]:
        when = (
            datetime.datetime.fromtimestamp(c["time"]).isoformat(sep=" ", timespec="seconds")
            if c["time"]
            else ""
        )
        state = "complete" if c["complete"] else f"INCOMPLETE ({c['reason']})"
        if c["latest"]:
            state += " (latest)"
        rows.append(
            [
                c["name"],
                str(c["step"]),
                state,
                human_bytes(c["size_bytes"]),
                str(c["world_size"] or ""),
                when,
                _metrics_text(c["metrics"]),
            ]
        )
    headers = ["save", "step", "state", "size", "ranks", "saved", "metrics"]
    align = "lrlrrll"
    # a column no save fills (the time and metrics only the manager's marker records) is left out
    kept = [i for i in range(len(headers)) if i < 4 or any(row[i] for row in rows)]
    producers = sorted({c["producer"] for c in d["checkpoints"]})
    return f"{d['root']} ({', '.join(producers)})\n" + table(
        [headers[i] for i in kept],
        [[row[i] for i in kept] for row in rows],
        align="".join(align[i] for i in kept),
    )


@click.command("prune")
@click.argument("root", type=click.Path())
@click.option("--keep-last", type=click.IntRange(min=1), default=None, help="Keep the newest N.")
@click.option(
    "--keep-every",
    type=click.IntRange(min=1),
    default=None,
    help="Also keep every step divisible by K.",
)
@click.option(
    "--keep-best",
    type=click.IntRange(min=1),
    default=None,
    help="Also keep the N best by --metric.",
)
@click.option("--metric", default=None, help="Metric name recorded at save time (for --keep-best).")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True)
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@json_option
@storage_options_option
def prune_command(
    root: str,
    keep_last: int | None,
    keep_every: int | None,
    keep_best: int | None,
    metric: str | None,
    mode: str,
    dry_run: bool,
    as_json: bool,
    storage_options: str | None,
) -> None:
    """Delete complete checkpoints under ROOT that a retention policy does not keep.

    The newest complete checkpoint is always kept; incomplete ones are left alone (a training
    job may be writing them). Run it while no job saves to ROOT.

    \b
    Examples:
      ckpt prune checkpoints/ --keep-last 3 --dry-run
      ckpt prune checkpoints/ --keep-last 2 --keep-every 1000
    """
    from ckptools.errors import UsageError
    from ckptools.training.retention import RetentionPolicy
    from ckptools.training.store import prune

    if keep_last is None and keep_every is None and keep_best is None:
        raise UsageError("give at least one of --keep-last, --keep-every, --keep-best")
    policy = RetentionPolicy(
        keep_last=keep_last,
        keep_every=keep_every,
        keep_best=keep_best,
        metric=metric,
        mode="max" if mode == "max" else "min",
    )
    result = prune(root, policy, dry_run=dry_run, storage_options=storage_options)
    emit(result, as_json, _render_prune)


def _render_prune(d: dict[str, Any]) -> str:
    verb = "would delete" if d["dry_run"] else "deleted"
    freed = human_bytes(d["freed_bytes"])
    lines = [f"{d['root']}: {verb} {len(d['delete'])} checkpoint(s), {freed}"]
    lines.extend(f"  {verb}: step-{step}" for step in d["delete"])
    reasons = d["reasons"]  # JSON keys are strings
    lines.extend(f"  kept: step-{step} ({', '.join(reasons[str(step)])})" for step in d["keep"])
    return "\n".join(lines)
