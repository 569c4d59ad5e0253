"""The ``ckpt`` group: errors turned into one line and an exit code, and the commands."""

from __future__ import annotations

import errno
import logging
import sys
from typing import Any

import click

from ckptools import collective
from ckptools.cli.exit_codes import EXIT_ERROR, EXIT_USAGE
from ckptools.errors import CkptError, UsageError

_ENVIRONMENT_ERRNOS = {
    errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
    errno.ENOTDIR, errno.EEXIST, errno.EISDIR,
}  # fmt: skip


class _Group(click.Group):
    """Turns :class:`CkptError` into one stderr line and an exit code (``--debug``: traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CkptError as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {e}", err=True)
            ctx.exit(EXIT_USAGE if isinstance(e, UsageError) else EXIT_ERROR)
        except OSError as e:
            # The environment's refusals (disk full, quota, read-only, permissions) are the
            # user's to fix, not bugs: one line, naming the file. Writers have already removed
            # their temporary output, so nothing that looks complete is left.
            if e.errno not in _ENVIRONMENT_ERRNOS or (ctx.obj and ctx.obj.get("debug")):
                raise
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"error: {where}{e.strerror}; nothing was written", err=True)
            ctx.exit(EXIT_ERROR)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks and debug logging.")
@click.version_option(package_name="ckptools")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Inspect, consolidate, reshard and verify PyTorch distributed checkpoints.

    Reads DCP directories (FSDP1/FSDP2/HSDP/TP, accelerate, Trainer, Lightning, torchtitan),
    Hugging Face safetensors and torch.save files, without running code stored in them.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING)


def _register() -> None:
    from ckptools.cli import (
        consolidate_cmd,
        inspect_cmd,
        push_cmd,
        reshard_cmd,
        training_cmd,
        verify_cmd,
    )

    for command in (
        inspect_cmd.inspect_command,
        consolidate_cmd.consolidate_command,
        verify_cmd.verify_command,
        verify_cmd.diff_command,
        verify_cmd.checksum_command,
        reshard_cmd.reshard_command,
        reshard_cmd.shard_command,
        training_cmd.list_command,
        training_cmd.prune_command,
        push_cmd.push_command,
    ):
        cli.add_command(command)


_register()


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="ckpt")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            collective.leave_if_launched(e.code or 0)
        raise


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
