"""The ``ckpt`` group: error handling, exit codes and the commands."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from ..errors import CkptError, UsageError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_DIFFERENCES = 3


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
    from . import inspect_cmd

    cli.add_command(inspect_cmd.inspect_command)


_register()


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="ckpt")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
