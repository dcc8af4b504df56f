"""The `vericache-hf` command line, without loading a model: `--version`, a default in every option's help, one
list syntax (comma-separated) in every subcommand."""

from __future__ import annotations

import re

import pytest

from vericache_hf import __version__
from vericache_tools.cli import build_parser, main

SUBCOMMANDS = ("demo", "bench", "table")


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def option_entries(text: str) -> dict[str, str]:
    """The options section of a help text: each option's flags -> its help, on one line."""
    entries: dict[str, str] = {}
    flags = None
    for line in text.split("options:", 1)[1].splitlines():
        if re.match(r"^  -", line):
            flags, _, rest = line.strip().partition("  ")
            entries[flags] = rest.strip()
        elif flags is not None and line.startswith("    "):
            entries[flags] += " " + line.strip()
    return entries


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"vericache-hf {__version__}\n"


def test_top_level_help_lists_the_subcommands(capsys):
    text = help_text(capsys)
    assert "{demo,bench,table,serve}" in text and "--version" in text


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_option_has_help_with_its_default(capsys, command):
    entries = option_entries(help_text(capsys, command))
    options = {flags: text for flags, text in entries.items() if flags != "-h, --help"}
    assert len(options) >= 5, entries
    missing = [flags for flags, text in options.items() if "(default:" not in text]
    assert not missing, f"{command}: options whose help shows no default: {missing}"


# The list options of bench and table, each with a comma-separated value and what it parses to.
LIST_OPTIONS = [
    ("bench", "--ratios", "0.5,0.875", [0.5, 0.875]),
    ("table", "--ratios", "0.5,0.875", [0.5, 0.875]),
    ("bench", "--compressors", "snapkv,kivi", ["snapkv", "kivi"]),
    ("table", "--compressors", "snapkv,kivi", ["snapkv", "kivi"]),
    ("bench", "--contexts", "2048,4096", [2048, 4096]),
    ("bench", "--batch-sizes", "1,4", [1, 4]),
    ("bench", "--kinds", "code,qa", ["code", "qa"]),
    ("bench", "--peers", "prompt_lookup", ["prompt_lookup"]),
    ("bench", "--draft-schedules", "adaptive,cost_aware", ["adaptive", "cost_aware"]),
]


@pytest.mark.parametrize("command, option, value, expected", LIST_OPTIONS)
def test_list_options_take_comma_separated_values(command, option, value, expected):
    args = build_parser().parse_args([command, option, value])
    assert getattr(args, option[2:].replace("-", "_")) == expected


@pytest.mark.parametrize("command", ["bench", "table"])
def test_space_separated_lists_are_refused_the_same_way(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--ratios", "0.5", "0.75"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: 0.75" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "table"])
def test_list_defaults_are_lists_and_unknown_names_are_refused(command, capsys):
    args = build_parser().parse_args([command])
    assert isinstance(args.ratios, list) and all(isinstance(r, float) for r in args.ratios)
    assert isinstance(args.compressors, list) and all(isinstance(c, str) for c in args.compressors)
    if command == "table":
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--compressors", "snapkv,nonsense"])
        assert "nonsense" in capsys.readouterr().err
