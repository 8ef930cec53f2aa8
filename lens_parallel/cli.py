"""``lens-parallel``: the command line.

    lens-parallel decompose|scale|diagonal|sensitivity|dominance|checks|compress [--model M] [options] [--out DIR]
    lens-parallel report [--model M [M ...]]        # the standard battery, one self-contained report.html
    lens-parallel train --preset cpu-small          # training-time interventions, paired by seed
    lens-parallel tasks --settings value:s_par=0    # downstream tasks (lm-evaluation-harness) under edits
    lens-parallel models                            # what loads offline now, what needs the hub
    lens-parallel protocols                         # the named protocols (a study's saved settings)
    lens-parallel --version

This module only parses: it builds argparse from the saved parser (``assets/cli_spec.json``, generated from the
package's options objects by :func:`lens_parallel.commands.parser_spec`) with the standard library alone, so
``--help`` and a bad command line answer before torch, TransformerLens or any analysis is imported. A parsed
command runs in :mod:`lens_parallel.commands`. Bad input exits with status 2 and one line on stderr; a failed
environment with status 3; anything else keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from collections.abc import Callable
from typing import Any

from lens_parallel import __version__
from lens_parallel.paths import SPEC_PATH
from lens_parallel.validate import did_you_mean


def _int_or_word(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


ARGUMENT_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "int_or_word": _int_or_word}
"""How an option's values are read, by the name the saved parser gives its type."""
ACTIONS: dict[str, type[argparse.Action]] = {"boolean_optional": argparse.BooleanOptionalAction}


class _Parser(argparse.ArgumentParser):
    """argparse with the package's error contract: a bad command line is one line on stderr and exit status 2. An
    option is spelled whole (no prefix of it is taken: ``--n-doc`` is not ``--n-docs``); an unknown one is refused by
    its command's parser, naming the closest of that command's options and its help; a renamed flag (the saved
    parser's ``renamed``: old -> new) is named with its new spelling."""

    renamed: typing.ClassVar[dict[str, str]] = {}

    def __init__(self, *args: Any, flags: tuple[str, ...] = (), **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.flags = flags
        self.commands: dict[str, _Parser] = {}

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # refused by the command's own parser: its options are the ones to suggest
            self.commands.get(getattr(parsed, "command", ""), self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message: str) -> typing.NoReturn:
        if choice := re.match(r"argument [^:]+: invalid choice: '([^']*)' \(choose from (.*)\)$", message):
            accepted = re.findall(r"'([^']*)'|([^,\s]+)", choice.group(2))
            message += did_you_mean(choice.group(1), [quoted or bare for quoted, bare in accepted])
        if message.startswith("unrecognized arguments:"):
            given = [flag.split("=")[0] for flag in message.split(":", 1)[1].split() if flag.startswith("-")]
            renamed = [old for old in given if old in self.renamed]
            if renamed:
                message = f"{renamed[0]} is now {self.renamed[renamed[0]]}"
            elif given:
                message += did_you_mean(given[0], self.flags)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(spec: dict[str, Any] | None = None) -> _Parser:
    """The ``lens-parallel`` parser, from ``spec`` (default: the saved one, :data:`SPEC_PATH`)."""
    if spec is None:
        spec = json.loads(SPEC_PATH.read_text(encoding="utf-8"))
    _Parser.renamed = dict(spec.get("renamed", {}))
    parser = _Parser(prog=spec["prog"], description=spec["description"])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, command in spec["commands"].items():
        flags = tuple(argument["flag"] for argument in command["arguments"])
        p = sub.add_parser(name, help=command["help"], description=command["help"], flags=flags)
        parser.commands[name] = p
        for argument in command["arguments"]:
            kwargs = dict(argument["kwargs"])
            if kwargs.get("default") == argparse.SUPPRESS:  # argparse compares its sentinel by identity
                kwargs["default"] = argparse.SUPPRESS
            if "type" in kwargs:
                kwargs["type"] = ARGUMENT_TYPES[kwargs["type"]]
            if "action" in kwargs:
                kwargs["action"] = ACTIONS[kwargs["action"]]
            p.add_argument(argument["flag"], **kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's arguments) and run the command (:func:`lens_parallel.commands.run`);
    returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a bad command line (one line on stderr, status 2)
        return int(exc.code or 0)
    from lens_parallel.commands import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
