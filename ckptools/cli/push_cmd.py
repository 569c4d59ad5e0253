"""``ckpt push``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ckptools.cli.options import dry_run_option, json_option, quiet_option
from ckptools.cli.render import dumps, emit, human_size, table


@click.command("push")
@click.argument("directory", type=click.Path())
@click.argument("repo_id")
@click.option(
    "--private", is_flag=True, help="Create the repository private; refuse an existing public one."
)
@click.option("--revision", default=None, help="Branch to push to (created if missing).")
@click.option("--commit-message", default=None, help="Commit summary.")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing.")
@click.option(
    "--token", default=None, help="Hub token. Default: HF_TOKEN, or the saved `hf auth login`."
)
@click.option(
    "--endpoint", default=None, help="Hub URL. Default: HF_ENDPOINT, or https://huggingface.co."
)
@click.option(
    "--source",
    type=click.Path(),
    default=None,
    help="The checkpoint DIRECTORY was consolidated from: recorded in the model card "
    "(layout, world size, step).",
)
@click.option(
    "--weights-only",
    is_flag=True,
    help="Publish a directory without config.json: its weights alone, which from_pretrained "
    "cannot load (refused without this flag).",
)
@dry_run_option("Check and list the files with sizes; no network, no upload.")
@quiet_option
@json_option
def push_command(
    directory: str,
    repo_id: str,
    private: bool,
    revision: str | None,
    commit_message: str | None,
    create_pr: bool,
    token: str | None,
    endpoint: str | None,
    source: str | None,
    weights_only: bool,
    dry_run: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Publish the model directory DIRECTORY to the Hugging Face Hub repository REPO_ID.

    Refuses a directory that is not a complete model (missing or truncated shard, index and
    files disagree, no weights) and any file over the Hub's per-file limit, before uploading
    anything. Adds a model card (README.md: library, tags, source checkpoint, step, world size,
    dtype, sha256 of every file) unless DIRECTORY has one. Creates the repository if needed.
    Re-running after a failure resumes: files already on the Hub are not sent again.

    \b
    Examples:
      ckpt push hf_model me/llama-1b-sft --private
      ckpt push hf_model me/llama-1b-sft --source checkpoints/step-1000 --dry-run
      ckpt push hf_model org/model --revision step-1000 --commit-message "step 1000"
      ckpt push hf_model org/model --create-pr
    """
    from ckptools.hub import push_to_hub

    result = push_to_hub(
        directory,
        repo_id,
        private=private,
        revision=revision,
        commit_message=commit_message,
        create_pr=create_pr,
        token=token,
        endpoint=endpoint,
        source=source,
        dry_run=dry_run,
        quiet=quiet or as_json,
        weights_only=weights_only,
    )
    emit(result, as_json, render_push)


def render_push(d: dict[str, Any]) -> str:
    """Human text for a :class:`~ckptools.hub.PushResult` dict (sizes in decimal units, as the
    Hub states its limit and ``--max-shard-size`` reads them)."""
    lines = []
    target = d["repo_id"] + (f" @ {d['revision']}" if d["revision"] else "")
    if d["dry_run"]:
        lines.append(f"{d['directory']} -> {target} (dry run: nothing sent)")
    else:
        made = "new repository" if d["created_repo"] else "existing repository"
        lines.append(f"{d['directory']} -> {target} ({made}{', private' if d['private'] else ''})")
    for note in d["notes"]:
        lines.append(f"  note: {note}")
    rows = [
        [
            f["name"] + ("  (generated model card)" if f["generated"] else ""),
            human_size(f["bytes"]),
        ]
        for f in d["files"]
    ]
    lines.append("")
    lines.append(table(["file", "size"], rows, "lr"))
    lines.append("")
    largest = max((f["bytes"] for f in d["files"]), default=0)
    lines.append(
        f"  {len(d['files'])} files, {human_size(d['total_bytes'])}; largest "
        f"{human_size(largest)}, Hub limit {human_size(d['max_file_bytes'])} per file"
    )
    if d["dry_run"]:
        lines.append(f"  would commit: {d['commit_message']}")
    else:
        lines.append(f"  committed in {d['seconds']:.1f} s: {d['commit_message']}")
        if d["pr_url"]:
            lines.append(f"  pull request: {d['pr_url']}")
        lines.append(f"  commit: {d['commit_url']}")
    return "\n".join(lines)


def check_push_option(repo_id: str, max_shard_size: str) -> None:
    """``ckpt consolidate --push-to-hub``: what can be refused before consolidating."""
    from ckptools.hub import preflight

    preflight(repo_id, max_shard_size=max_shard_size)


def push_consolidated(
    data: dict[str, Any],
    repo_id: str,
    *,
    as_json: bool,
    quiet: bool,
    render: Callable[[dict[str, Any]], str],
) -> None:
    """``ckpt consolidate --push-to-hub``: print the consolidation, then push OUT (recording SRC
    as its source) and print that; with ``--json`` one object whose ``push`` holds the push.

    A dry run pushes nothing: it checks the planned files against the Hub's per-file limit.
    """
    from ckptools.errors import CkptError
    from ckptools.hub import check_sizes, push_to_hub, resolve_max_file_bytes

    out, src = data["out"], data["src"]
    if not as_json:
        click.echo(render(data))
    if data["dry_run"]:
        planned = [(f["name"], f["bytes"]) for f in data["files"]]
        check_sizes(planned, resolve_max_file_bytes(), directory=out, repo_id=repo_id, source=src)
        data["push"] = None
        if not as_json:
            click.echo(f"  would push to {repo_id}: every planned file is within the Hub's limit")
    else:
        try:
            # OUT without config.json was asked for (consolidate --weights-only) and noted
            pushed = push_to_hub(
                out, repo_id, source=src, quiet=quiet or as_json, weights_only=True
            )
        except CkptError:
            click.echo(
                f"note: {out} was consolidated; push it with: ckpt push {out} {repo_id} "
                f"--source {src}",
                err=True,
            )
            raise
        data["push"] = pushed.to_dict()
        if not as_json:
            click.echo("")
            click.echo(render_push(data["push"]))
    if as_json:
        click.echo(dumps(data))
