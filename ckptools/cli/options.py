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
