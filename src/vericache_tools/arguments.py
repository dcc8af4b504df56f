"""What every `vericache-hf` subcommand shares: one list syntax (comma-separated) and help that shows defaults."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default after its help; every option has a help string so that it is shown."""


def comma_list(convert: Callable[[str], Any] = str, choices: Iterable[str] | None = None) -> Callable:
    """An argparse `type` for a comma-separated list, such as `--ratios 0.75,0.875`: `convert` turns each item into
    a value, and `choices` (for names) restricts them. Give defaults in the same syntax (`default="0.75,0.875"`):
    argparse parses a string default like a command-line value, and the help then shows it as one would type it."""
    allowed = sorted(choices) if choices is not None else None

    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list such as a,b; got {text!r}")
        unknown = [item for item in items if allowed is not None and item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(allowed)}")
        return [convert(item) for item in items]

    parse.__name__ = f"comma-separated {getattr(convert, '__name__', 'value')}"  # argparse names it in errors
    return parse
