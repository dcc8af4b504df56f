"""`vericache-hf` command line: one subcommand per job, each defined beside the code it runs.

Every option's help shows its default, and every list option takes the same syntax: comma-separated values, such
as `--ratios 0.75,0.875`."""

from __future__ import annotations

import argparse
import sys

from vericache_hf import __version__

from .arguments import HelpFormatter
from .bench import add_bench_command
from .demo import add_demo_command
from .table import add_table_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vericache-hf",
        description="Lossless KV-cache compression for HuggingFace Transformers. Lists are comma-separated.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"vericache-hf {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,table,serve}")
    add_demo_command(subparsers)
    add_bench_command(subparsers)
    add_table_command(subparsers)
    # `serve` is transformers' typer command with VeriCache's options: `main` hands it its arguments before argparse
    # sees them; this entry only lists it.
    subparsers.add_parser(
        "serve",
        help="transformers serve (OpenAI-compatible HTTP) with VeriCache in every request; see serve --help",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from .serve_command import main as serve_main  # needs the serve extra: imported only for this command

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
