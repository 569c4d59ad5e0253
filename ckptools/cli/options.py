"""Options shared by several commands, defined once.

Each option's name is the library's keyword argument (``--max-shard-size`` ↔ ``max_shard_size``)
and its default is the library's: a command passes what it parsed through unchanged, so the CLI
never holds a second default (``--workers`` left unset is ``None``, which the library resolves as
:func:`ckptools.io.tunables.workers` says).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ckptools.io import tunables
from ckptools.producers.registry import declared
from ckptools.producers.registry import names as registry_names

F = TypeVar("F", bound=Callable[..., Any])

#: what ``--format`` takes: the registry's names (imports no layout)
FORMAT_NAMES = registry_names()


def producers_say(place: str) -> tuple[Any, ...]:
    """What the producers' packages say at ``place`` of the CLI's help (each one's ``HELP``, in
    registry order; imports no reader): a producer's own words are written there, never here."""
    return tuple(text for at, text in declared("HELP") if at == place)


def filled(**texts: str) -> Callable[[F], F]:
    """Put each text in the ``{name}`` of the command's docstring (its ``--help``)."""

    def fill(f: F) -> F:
        doc = f.__doc__ or ""
        for name, text in texts.items():
            doc = doc.replace("{" + name + "}", text)
        f.__doc__ = doc
        return f

    return fill


def examples(place: str) -> str:
    """The producers' example lines at ``place``, each on its own line of an examples block."""
    return "".join(f"\n      {line}" for line in producers_say(place))


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")(f)


def quiet_option(f: F) -> F:
    """``--quiet/-q``; ``--json`` implies it (a progress bar would interleave with the JSON)."""
    return click.option("--quiet", "-q", is_flag=True, help="No progress bar.")(f)


def workers_option(f: F) -> F:
    return click.option(
        "--workers",
        type=click.IntRange(min=1),
        default=None,
        help=f"I/O threads (files read or pieces written in parallel). Default: "
        f"{tunables.WORKERS_ENV}, else {tunables.DEFAULT_WORKERS} (one per CPU, at most 4).",
    )(f)


def overwrite_option(f: F) -> F:
    return click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")(f)


def dry_run_option(help: str = "Print the plan; write nothing.") -> Callable[[F], F]:
    """``--dry-run``, with the command's own words for what it shows instead of doing."""

    def decorate(f: F) -> F:
        return click.option("--dry-run", is_flag=True, help=help)(f)

    return decorate


def format_option(f: F) -> F:
    return click.option(
        "--format",
        type=click.Choice(FORMAT_NAMES),
        default=None,
        help="Force the checkpoint layout instead of detecting it.",
    )(f)


def tolerance_options(f: F) -> F:
    """``--atol`` and ``--rtol``: unset means bit-exact."""
    f = click.option(
        "--rtol", type=float, default=None, help="Relative tolerance (default: bit-exact)."
    )(f)
    return click.option(
        "--atol", type=float, default=None, help="Absolute tolerance (default: bit-exact)."
    )(f)


def storage_options_option(f: F) -> F:
    return click.option(
        "--storage-options",
        default=None,
        metavar="JSON",
        help="fsspec options for URL paths (s3://, gs://...) as a JSON object, e.g. "
        '\'{"endpoint_url": "http://127.0.0.1:9000"}\', or one per protocol '
        '\'{"s3": {...}, "gs": {...}}\'. Credentials and endpoints otherwise come from the '
        "environment (AWS_*, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS...).",
    )(f)


_ITERATION = "ckptools_iteration"


def _keep_iteration(ctx: click.Context, _: click.Parameter, value: int | None) -> None:
    ctx.meta[_ITERATION] = value


def tag_option(f: F) -> F:
    """``--tag`` / ``--iteration``: which save of a run directory to read (not library
    keywords: the command resolves them to the save's own path with :func:`at_tag`, which
    every verb accepts)."""
    f = click.option(
        "--iteration",
        type=click.IntRange(min=0),
        default=None,
        expose_value=False,
        callback=_keep_iteration,
        help=" ".join(producers_say("--iteration")),
    )(f)
    return click.option(
        "--tag",
        default=None,
        metavar="TAG",
        help="Read the save TAG inside the run directory: a DeepSpeed tag (e.g. global_step100) "
        "instead of the one 'latest' names, or any run's save by name (checkpoint-500).",
    )(f)


def at_tag(path: str, tag: str | None) -> str:
    """``path``, or with ``--tag`` the save ``tag`` inside it (checked to be there), or with
    ``--iteration`` that iteration's save of a run numbered by iteration (the producer that
    declares ``ITERATIONS`` finds it)."""
    ctx = click.get_current_context(silent=True)
    iteration = ctx.meta.get(_ITERATION) if ctx is not None else None
    if iteration is not None:
        if tag is not None:
            raise click.UsageError("--tag and --iteration both name a save: give one")
        from importlib import import_module

        numbered = import_module(f"ckptools.producers.{declared('ITERATIONS')[0]}")
        found: str = numbered.iteration_dir(path, iteration)
        return found
    if tag is None:
        return path
    from ckptools.producers.deepspeed.files import choose_tag

    return choose_tag(path, tag)
