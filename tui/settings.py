"""osft-tui's settings kept between sessions: the theme chosen (Textual's palette: Theme).

They live in ``$XDG_CONFIG_HOME/osft-tui/settings.json`` (``~/.config`` without it); a file that
cannot be read or written is ignored: the settings are a convenience, never a reason to fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def settings_path() -> Path:
    """Where the settings are kept."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "osft-tui" / "settings.json"


def load() -> dict:
    """The settings saved ({} when there are none or they cannot be read)."""
    try:
        data = json.loads(settings_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save(**changed: object) -> None:
    """Save ``changed`` over the settings saved (nothing when that fails)."""
    path = settings_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**load(), **changed}, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass
