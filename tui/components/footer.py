"""The key footer of osft-tui's screens: Textual's :class:`~textual.widgets.Footer`, rebuilt only
when the keys it shows change.

Textual's footer rebuilds all its key widgets on every bindings signal of its screen: each focus
change and each return to the screen (closing the help or a dialog), even when the same keys come
back. On the dashboard that is about twenty widgets mounted and styled again in the frame that
should show the screen at once; this footer compares what it would show (key, label, action,
enabled, tooltip of each shown binding) with what it shows and skips the rebuild when they are equal.
"""

from __future__ import annotations

from textual.screen import Screen
from textual.widgets import Footer


def shown_keys(screen: Screen) -> tuple:
    """What a footer of ``screen`` shows: per shown active binding its key, description, action,
    whether it is enabled and its tooltip."""
    return tuple((binding.key, binding.description, binding.action, enabled, tooltip)
                 for _node, binding, enabled, tooltip in screen.active_bindings.values() if binding.show)


class KeyFooter(Footer):
    """A :class:`~textual.widgets.Footer` that rebuilds only when :func:`shown_keys` changes."""

    _shown: tuple | None = None

    def bindings_changed(self, screen: Screen) -> None:
        if screen is self.screen and self.is_attached and screen.app.app_focus:
            shown = shown_keys(screen)
            if shown == self._shown:
                return
            self._shown = shown
        super().bindings_changed(screen)
