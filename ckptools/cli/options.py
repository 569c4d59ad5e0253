"""Options shared by several commands, defined once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

FORMAT_NAMES = (
    "trainer",
    "accelerate",
    "lightning",
    "torchtitan",
    "dcp",
    "safetensors",
    "torch_save",
)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")(f)


def format_option(f: F) -> F:
    return click.option(
        "--format",
        type=click.Choice(FORMAT_NAMES),
        default=None,
        help="Force the checkpoint layout instead of detecting it.",
    )(f)
