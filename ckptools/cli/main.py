"""The ``ckpt`` group: errors turned into one line and an exit code, and the commands."""

from __future__ import annotations

import errno
import logging
import sys
import traceback
from typing import Any

import click

from ckptools.cli import interrupts
from ckptools.cli.exit_codes import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE
from ckptools.cli.options import filled, producers_say
from ckptools.cli.render import dumps
from ckptools.engine import collective
from ckptools.errors import CkptError, UsageError
from ckptools.io import storage

_ENVIRONMENT_ERRNOS = {
    errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
    errno.ENOTDIR, errno.EEXIST, errno.EISDIR,
}  # fmt: skip


#: flags of the group that may also be written after the command (``ckpt inspect X --debug``)
_GROUP_FLAGS = ("--debug",)


def _before_separator(args: list[str]) -> list[str]:
    return args[: args.index("--")] if "--" in args else args


class _Group(click.Group):
    """Turns :class:`CkptError` into one line and an exit code (``--debug``: traceback), an
    interrupt into one line and 130, and with ``--json`` any error into one JSON object on
    stdout: ``{"error": ..., "exit_code": ...}``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        head = _before_separator(args)
        ctx.ensure_object(dict)
        ctx.obj["json"] = "--json" in head
        ctx.obj["urls"] = [a for a in head if storage.is_url(a)]  # named by a remote failure
        moved = [a for a in head if a in _GROUP_FLAGS]
        rest = [a for a in head if a not in _GROUP_FLAGS] + args[len(head) :]
        return super().parse_args(ctx, moved + rest)

    def invoke(self, ctx: click.Context) -> Any:
        def debug() -> bool:  # set by the group's callback, which runs inside the try
            return bool(ctx.obj and ctx.obj.get("debug"))

        try:
            with interrupts.raising():
                return super().invoke(ctx)
        except CkptError as e:
            if debug():
                _debug_details(e)
                raise
            _fail(ctx, str(e), EXIT_USAGE if isinstance(e, UsageError) else EXIT_ERROR)
        except OSError as e:
            # The environment's refusals (disk full, quota, read-only, permissions) are the
            # user's to fix, not bugs: one line, naming the file. Writers have already removed
            # their temporary output, so nothing that looks complete is left.
            if e.errno not in _ENVIRONMENT_ERRNOS or debug():
                raise
            where = f"{e.filename}: " if e.filename else ""
            _fail(ctx, f"{where}{e.strerror}; nothing was written", EXIT_ERROR)
        except click.exceptions.NoArgsIsHelpError:
            raise  # ``ckpt`` alone: the help, as click prints it
        except click.ClickException as e:  # a command's own usage error, e.g. a missing argument
            message = e.format_message()
            command = getattr(e, "ctx", None)
            if command is not None and not ctx.obj.get("json"):  # the way on, in the one line
                message = f"{message.rstrip('.')}; see `{command.command_path} --help`"
            _fail(ctx, message, e.exit_code)
        except Exception as e:
            said = storage.remote_failure(e)
            if said is None or debug():
                raise
            urls = ctx.obj.get("urls") or []
            _fail(ctx, f"{', '.join(urls)}: {said}" if urls else said, EXIT_ERROR)
        except KeyboardInterrupt as e:
            if debug():
                traceback.print_exc()
            _fail(ctx, interrupts.message(e), EXIT_INTERRUPTED, prefix="")


def _fail(ctx: click.Context, message: str, code: int, prefix: str = "error: ") -> None:
    """Report an error as one line on stderr, or with ``--json`` as one object on stdout (a
    script reading the JSON gets JSON whatever happened), and exit with ``code``."""
    if ctx.obj and ctx.obj.get("json"):
        click.echo(dumps({"error": message, "exit_code": code}))
    else:
        click.echo(f"{prefix}{message}", err=True)
    ctx.exit(code)


def _debug_details(e: CkptError) -> None:
    """What ``--debug`` shows beyond the one line: e.g. each layout's reason for refusing."""
    for line in getattr(e, "details", ()):
        click.echo(line, err=True)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--debug",
    is_flag=True,
    help="Show full tracebacks and debug logging (also accepted after the command).",
)
@click.version_option(package_name="ckptools")
@click.pass_context
@filled(
    reads="".join(f"\n      {label:<30}{example}" for label, example in producers_say("reads")),
    refuses="".join(f"\n      {label:<30}{why}" for label, why in producers_say("refuses")),
)
def cli(ctx: click.Context, debug: bool) -> None:
    """Inspect, consolidate, reshard and verify PyTorch distributed checkpoints, without
    running code stored in them. Point at the directory the producer wrote.

    \b
    Reads (one example each):
      DCP: FSDP2, FSDP1, HSDP, TP   ckpt inspect checkpoints/step-1000
      DCP saved without .metadata   ckpt verify checkpoints/step-1000
      accelerate save_state         ckpt consolidate ckpt_dir hf_model
      transformers Trainer          ckpt consolidate output_dir hf_model
      Lightning FSDPStrategy        ckpt inspect lightning/epoch=0-step=100.ckpt
      torchtitan                    ckpt reshard outputs/checkpoint ckpt-8 --world-size 8
      DeepSpeed ZeRO 1/2/3          ckpt consolidate ds_run hf_model --tag global_step100
      verl                          ckpt consolidate checkpoints/global_step_100 hf_model{reads}
      transformers distributed      ckpt consolidate tp_model hf_model
      PEFT LoRA (on any of them)    ckpt consolidate lora_ckpt adapter --adapter --lora-alpha 16
      Hugging Face safetensors      ckpt shard hf_model ckpt-8 --world-size 8
      torch.save (.pt .pth .bin)    ckpt consolidate checkpoint.pth hf_model --key model_state_dict

    \b
    Recognised and refused in one line (nothing written):{refuses}

    `ckpt COMMAND --help` for each command; --debug (anywhere) shows tracebacks.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING)
    if not debug:
        _quiet_libraries()


def _own_or_error(record: logging.LogRecord) -> bool:
    return record.name.partition(".")[0] == "ckptools" or record.levelno >= logging.ERROR


def _quiet_libraries() -> None:
    """Without --debug, the libraries ckptools imports say nothing below an error: their
    import-time warnings (torchao's extension it cannot load, torch deprecating what torchao
    registers, imported by transformers whenever torchao is installed) are not the user's
    business, and the one line is ckptools'. --debug shows them all."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_own_or_error)
    # torch's own handler (glog-style) prints this logger's records, not the root's
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


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
