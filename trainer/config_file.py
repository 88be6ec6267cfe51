"""Config files of ``osft-train``: ``--config run.yaml`` and ``--print-config``.

A config file is a YAML mapping from training flag names, with underscores (the
:class:`~.config.TrainConfig` field names: ``learning_rate``, ``osft: false`` for ``--no-osft``),
to values. Each value goes through the parser's own ``type`` function and ``choices``, as on the
command line; command-line flags override the file. :func:`config_to_yaml` writes the fully
resolved config in the same format, so that it reads back into an equal ``TrainConfig``.
:func:`convert_settings` checks a mapping given in code (the Python API, :mod:`osft.trainer.launch.api`) the same way.

YAML merge keys work (``<<: *common`` or ``<<: {batch_size: 2}``) as ``yaml.safe_load`` merges
them: the file's own keys override merged ones, a later mapping of a merge list an earlier one, and top-level keys starting with :data:`HELPER_PREFIX` are
ignored, so a file can hold the mappings it merges (``_common: &common {...}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import ONE_TIME_FIELDS, TrainConfig

#: First line of every file :func:`config_to_yaml` writes.
HEADER = "# osft-train --config file: flag names with underscores; command-line flags override these values\n"


#: Top-level keys starting with this are helpers (anchors to merge), not settings: they are ignored.
HELPER_PREFIX = "_"


class ConfigFileError(ValueError):
    """A config file that cannot be read, is not valid YAML, or holds an unknown key or a bad value;
    the message starts with ``file:line:`` where there is a line to point at."""


def _nullable_fields() -> set[str]:
    """``TrainConfig`` fields that may be None (null in a config file)."""
    hints = typing.get_type_hints(TrainConfig)
    return {name for name, hint in hints.items() if type(None) in typing.get_args(hint)}


def _describe(value: Any) -> str:
    return {list: "a list", dict: "a mapping"}.get(type(value), repr(value))


def _convert_one(action: argparse.Action, value: Any) -> Any:
    """One value as the command line would parse it: the action's ``type`` on its text, then its ``choices``.

    Raises:
        ValueError: the value is rejected; the message says what is allowed.
    """
    if isinstance(value, (list, dict)):
        raise ValueError(f"expected a single value, got {_describe(value)}")
    text = str(value)  # as on the command line; PyYAML reads 1e-5 as a string (YAML 1.1)
    try:
        converted = action.type(text) if action.type else text
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    except (TypeError, ValueError):
        raise ValueError(f"expected {getattr(action.type, '__name__', 'a valid')} value, got {text!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"invalid choice {text!r} (choose from {', '.join(map(str, action.choices))})")
    return converted


def _convert(action: argparse.Action, value: Any, nullable: bool) -> Any:
    """The setting that ``value`` from the file gives the flag of ``action``.

    Switches take a YAML boolean (the field's value: ``osft: false`` is ``--no-osft``), flags with
    several values a list (``data_path`` also one path), others one scalar; null is allowed where the field may be None.

    Raises:
        ValueError: the value is rejected; the message says what is allowed.
    """
    if action.nargs == 0:
        if value is None and nullable:  # a switch whose default is decided at run time
            return None
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {_describe(value)}")
        return value
    if value is None:
        if nullable:
            return None
        raise ValueError("needs a value, got null")
    if action.nargs in ("+", "*"):
        if action.dest == "data_path" and not isinstance(value, (list, dict)):
            value = [value]  # one source, or a list of them (a mixture)
        if not isinstance(value, list) or not value:
            raise ValueError(f"expected a non-empty list, got {_describe(value)}")
        return [_convert_one(action, item) for item in value]
    return _convert_one(action, value)


def _suggestion(key: str, actions: dict[str, argparse.Action]) -> str:
    """``; did you mean ...?`` for an unknown key: the flag it spells as an option name
    (``learning-rate``, ``no_osft``), else the closest key; empty when nothing is close."""
    spelled = key.lstrip("-").replace("-", "_")
    for dest, action in actions.items():
        for option in action.option_strings:
            if option.lstrip("-").replace("-", "_") == spelled:
                hint = dest if spelled == dest else f"{dest}: {str(action.const).lower()}"
                return f"; did you mean '{hint}'?"
    import difflib  # here, not at the top: only an unknown key needs it (`osft-train --help` start-up)

    close = difflib.get_close_matches(spelled, actions, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _training_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``parser``'s actions of the :class:`~.config.TrainConfig` fields, by field name."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return {a.dest: a for a in parser._actions if a.dest in fields}


def _unknown_key(key: str, actions: dict[str, argparse.Action]) -> str:
    """The message for a key that is no training flag, with the closest key."""
    return f"unknown key '{key}'{_suggestion(key, actions)}"


def convert_settings(settings: Mapping[str, Any], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Check and convert a mapping keyed like a config file (``{"learning_rate": 1e-5, "osft": False}``)
    as :func:`read_config_file` checks a file's mapping, for settings given in code.

    Returns:
        the settings by field name, converted as the command line converts them.

    Raises:
        ConfigFileError: a key is no training flag (the closest one is suggested), or a value is
            rejected by the flag's type or choices (``key: what is allowed``).
    """
    actions, nullable = _training_actions(parser), _nullable_fields()
    converted: dict[str, Any] = {}
    for name, value in settings.items():
        key = str(name)
        if key not in actions:
            raise ConfigFileError(_unknown_key(key, actions))
        try:
            converted[key] = _convert(actions[key], value, key in nullable)
        except ValueError as exc:
            raise ConfigFileError(f"{key}: {exc}") from None
    return converted


def read_config_file(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read a config file and check every key and value against ``parser``'s training flags.

    Returns:
        the settings by field name, converted as the command line converts them.

    Raises:
        ConfigFileError: the file cannot be read or is not a YAML mapping; a key is no training
            flag (the closest one is suggested) or appears twice in the file's own keys; a value is
            rejected by the flag's type or choices. The message names the file and line. Merge keys
            and helper keys: see the module docstring.
    """
    import yaml  # here, not at the top: PyYAML is a third of `osft-train --help`'s start-up

    actions, nullable = _training_actions(parser), _nullable_fields()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"--config {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        loader = yaml.SafeLoader(text)
        root = loader.get_single_node()
        if root is None:
            return {}
        if not isinstance(root, yaml.MappingNode):
            raise ConfigFileError(f"{path}:{root.start_mark.line + 1}: expected a mapping of flag names to values "
                                  "(key: value lines)")
        own = {id(key_node) for key_node, _ in root.value}
        loader.flatten_mapping(root)  # merge keys: merged pairs first, the mapping's own pairs after them
        settings: dict[str, Any] = {}
        own_lines: dict[str, int] = {}
        for key_node, value_node in root.value:
            line = key_node.start_mark.line + 1
            key = str(loader.construct_object(key_node)) if isinstance(key_node, yaml.ScalarNode) else "(not a name)"
            if key.startswith(HELPER_PREFIX):
                continue
            if key not in actions:
                raise ConfigFileError(f"{path}:{line}: {_unknown_key(key, actions)}")
            if id(key_node) in own:
                if key in own_lines:
                    raise ConfigFileError(f"{path}:{line}: '{key}' given twice (also on line {own_lines[key]})")
                own_lines[key] = line
            try:
                settings[key] = _convert(actions[key], loader.construct_object(value_node, deep=True), key in nullable)
            except ValueError as exc:
                raise ConfigFileError(f"{path}:{line}: {key}: {exc}") from None
        return settings
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        reason = getattr(exc, "problem", None) or getattr(exc, "context", None) or exc
        raise ConfigFileError(f"{where}: invalid YAML: {reason}") from None


def parse_with_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with the settings of ``--config FILE`` (if given) as defaults, so
    command-line flags override the file, and the file overrides the parser's own defaults. Flags
    the file sets are no longer required on the command line (``parser`` is changed in place).

    Raises:
        ConfigFileError: see :func:`read_config_file`.
        SystemExit: a bad flag on the command line (argparse's own error, exit code 2).
    """
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    pre.add_argument("--config")
    try:
        path = pre.parse_known_args(argv)[0].config
    except argparse.ArgumentError:  # e.g. --config without a value: the full parser reports it
        path = None
    if path is not None:
        apply_settings(parser, read_config_file(path, parser))
    return parser.parse_args(argv)


def apply_settings(parser: argparse.ArgumentParser, settings: dict[str, Any]) -> None:
    """Make ``settings`` (converted: :func:`read_config_file`, :func:`convert_settings`) ``parser``'s
    defaults; the flags they set are no longer required (``parser`` is changed in place)."""
    for action in parser._actions:
        if settings.get(action.dest) is not None:
            action.required = False
    parser.set_defaults(**settings)


def config_to_yaml(cfg: TrainConfig) -> str:
    """``cfg`` as a config file: every field but :data:`ONE_TIME_FIELDS`, in declaration order,
    after :data:`HEADER`."""
    fields = {k: v for k, v in cfg.to_json().items() if k not in ONE_TIME_FIELDS}
    return HEADER + _dump(fields)


#: First line of a worker group's config (:func:`worker_config_yaml`).
WORKER_HEADER = "# config of one osft-train launch's torchrun worker group, written by its launcher\n"


def worker_config_yaml(cfg: TrainConfig) -> str:
    """``cfg`` as the config file a launcher hands its ranks (``osft.trainer.worker --config FILE``):
    every field that is not None, the one-time ones included; it reads back into an equal
    ``TrainConfig``, a None taking the rank's parser default (``--osft-cache-v-high``: from
    ``OSFT_CACHE_V``, as on the command line)."""
    return WORKER_HEADER + _dump({k: v for k, v in cfg.to_json().items() if v is not None})


def _dump(fields: dict[str, Any]) -> str:
    import yaml  # here, not at the top: PyYAML is a third of `osft-train --help`'s start-up

    return yaml.safe_dump(fields, sort_keys=False, default_flow_style=False)
