"""One training setting, declared once: a config field whose metadata carries its flag's help,
its allowed values and its resume rule (:func:`setting`), and what is generated from it: the
argparse flag (:func:`add_flag`), the flags that parse back into a value (:func:`flags_of`) and
the check of a value set in code (:func:`value_error`).

Names: the field ``max_tokens_per_gpu`` is the flag ``--max-tokens-per-gpu`` and the config-file
key ``max_tokens_per_gpu``; a switch whose default is on is the flag ``--no-<name>``. The YAML reader
(:mod:`.config_file`) converts a file's values through the same argparse flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
from collections.abc import Callable
from typing import Any

#: Key of a field's :class:`Setting` in its ``dataclasses.Field.metadata``.
SETTING = "osft_setting"


class Resume(enum.Enum):
    """What a resumed run may do with a setting the checkpoint recorded (trainer_state.json "settings")."""

    FREE = "free"  # not recorded: may change
    SAME = "same"  # a bit-identical resume needs it unchanged (else the resume is refused)
    WARN = "warn"  # may change: used from the first resumed step, with a warning


class IntAtLeast:
    """argparse type and range of an integer >= ``lo``; raises ``argparse.ArgumentTypeError`` on other text."""

    def __init__(self, lo: int) -> None:
        self.lo = lo
        self.what = "a positive integer" if lo == 1 else f"an integer >= {lo}"

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.what}, got {text!r}") from None
        if value < self.lo:
            raise argparse.ArgumentTypeError(f"expected {self.what}, got {text!r}")
        return value

    def error(self, value: Any) -> str | None:
        """Why ``value`` (set in code) is out of range, or None."""
        return None if isinstance(value, int) and value >= self.lo else f"must be at least {self.lo}, got {value}"


class Interval:
    """argparse type and range of a finite number in an interval (``lo_open``/``hi_open``: bound excluded)."""

    def __init__(self, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> None:
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        self.text = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def contains(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return math.isfinite(value) and above and below

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not self.contains(value):
            raise argparse.ArgumentTypeError(f"must be in {self.text}, got {text!r}")
        return value

    def error(self, value: Any) -> str | None:
        """Why ``value`` (set in code) is out of the interval, or None."""
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and self.contains(value)
        return None if ok else f"must be in {self.text}, got {value}"


class Setting:
    """What a config field declares besides its name, type and default (a plain class: a
    dataclass's generated methods would add to ``osft-train --help``'s start-up).

    ``values`` parses a flag's text (an :class:`IntAtLeast`, :class:`Interval`, ``int``; None: the
    text itself); ``many``: the flag takes one or more values (a list field); ``action``: a custom
    argparse action; ``no_help``: a switch with both ``--<name>`` and ``--no-<name>`` (this is the
    latter's help), whose default None is decided at run time unless ``env`` (1 or 0) sets it;
    ``required``: a path without a default (optional for ``osft-train demo``); ``one_time``: an
    action of one launch, never written to a config file.
    """

    __slots__ = ("help", "values", "choices", "metavar", "many", "action", "resume", "no_help", "env", "required",
                 "one_time")

    def __init__(self, help: str | None, *, values: Callable[[str], Any] | None = None,
                 choices: tuple[str, ...] | None = None, metavar: str | None = None, many: bool = False,
                 action: type[argparse.Action] | None = None, resume: Resume = Resume.FREE, no_help: str | None = None,
                 env: str | None = None, required: bool = False, one_time: bool = False) -> None:
        self.help, self.values, self.choices, self.metavar, self.many, self.action = help, values, choices, metavar, many, action
        self.resume, self.no_help, self.env, self.required, self.one_time = resume, no_help, env, required, one_time


def setting(default: Any = dataclasses.MISSING, help: str | None = None, **declared: Any) -> Any:
    """A config field with its :class:`Setting` (keyword-only when it has a default)."""
    return dataclasses.field(default=default, kw_only=default is not dataclasses.MISSING,
                             metadata={SETTING: Setting(help=help, **declared)})


def setting_of(field: dataclasses.Field) -> Setting:
    return field.metadata[SETTING]


def flag_name(name: str) -> str:
    """``max_seq_len`` -> ``--max-seq-len``."""
    return "--" + name.replace("_", "-")


def _no_flag(name: str) -> str:
    return "--no-" + name.replace("_", "-")


def _switch_default(env: str | None) -> bool | None:
    return {"1": True, "0": False}.get(os.environ.get(env, "")) if env else None


def add_flag(group: argparse._ActionsContainer, field: dataclasses.Field, require_paths: bool,
             help: str | None = None, metavar: str | None = None) -> None:
    """Add the flag (or flags, for a switch with two) of ``field`` to ``group``; ``help`` and
    ``metavar``, when given, replace the setting's own (a command that reads it otherwise)."""
    s, flag = setting_of(field), flag_name(field.name)
    help = s.help if help is None else help
    if s.no_help is not None:
        default = _switch_default(s.env)
        group.add_argument(flag, action="store_true", default=default, help=help)
        group.add_argument(_no_flag(field.name), dest=field.name, action="store_false", default=default, help=s.no_help)
        return
    if isinstance(field.default, bool):
        if field.default:
            group.add_argument(_no_flag(field.name), dest=field.name, action="store_false", help=help)
        else:
            group.add_argument(flag, action="store_true", help=help)
        return
    kwargs: dict[str, Any] = {"required": require_paths} if s.required else {"default": field.default}
    if s.values is not None:
        kwargs["type"] = s.values
    if s.many:
        kwargs["nargs"] = "+"
    for key, value in (("choices", s.choices), ("metavar", metavar or s.metavar), ("action", s.action)):
        if value is not None:
            kwargs[key] = value
    group.add_argument(flag, help=help, **kwargs)


def flags_of(field: dataclasses.Field, value: Any) -> list[str]:
    """The flags that give ``field`` the ``value`` (none for a switch left at its default, or None)."""
    s, flag = setting_of(field), flag_name(field.name)
    if s.no_help is not None or field.default is True:  # a switch with --no-<name>; None gives neither
        if value is False:
            return [_no_flag(field.name)]
        return [flag] if value is True and field.default is not True else []
    if isinstance(value, bool):
        return [flag] if value else []
    if isinstance(value, list):
        return [flag, *map(str, value)]
    if value is None:
        return []
    return [flag, repr(value) if isinstance(value, float) else str(value)]


def value_error(field: dataclasses.Field, value: Any) -> str | None:
    """Why ``value``, set in code rather than parsed from a flag, is outside the field's range or
    choices (``--flag must be ...``), or None; None values are not checked."""
    s = setting_of(field)
    for item in (value if s.many and isinstance(value, list) else [value]):
        if item is None:
            continue
        if s.choices is not None and item not in s.choices:
            return f"{flag_name(field.name)} must be one of {', '.join(s.choices)}, got {item!r}"
        error = getattr(s.values, "error", None)  # IntAtLeast, Interval
        reason = error(item) if error else None
        if reason:
            return f"{flag_name(field.name)} {reason}"
    return None


class RepeatableList(argparse.Action):
    """``nargs="+"`` that may be repeated: the values of every occurrence on the command line, in
    order, replacing the default (a config file's list) rather than extending it."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = f"_{self.dest}_given"
        before = list(getattr(namespace, self.dest) or []) if getattr(namespace, given, False) else []
        setattr(namespace, self.dest, before + list(values))
        setattr(namespace, given, True)


class DataPaths(argparse.Action):
    """``--data-path`` may be repeated and may take several values: they are collected in order. The
    first one on the command line replaces the default (a config file's list), later ones add to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, (list(given) if given is not self.default else []) + list(values))


class HelpFormatter(argparse.HelpFormatter):
    """Shows ``(default: X)`` only where a default says something (not for switches or None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default is None or isinstance(action.default, bool) or action.default == argparse.SUPPRESS
        if "%(default)" not in text and not quiet and action.option_strings:
            text += " (default: %(default)s)"
        return text
