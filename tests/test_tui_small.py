"""osft-tui at 80x24 (issue 20): every field and button of the new-run form can be reached with Tab
and is on screen when focused, dialogs keep their buttons on screen, and the footer always shows
? and q."""

from __future__ import annotations

import asyncio

from osft.tui.app import OsftTui
from osft.tui.components.modals import Choice
from osft.tui.components.new_run import NewRunScreen
from textual.widgets import Button
from textual.widgets._footer import FooterKey
from tui_support import wait_until

SIZE = (80, 24)


def on_screen(app, widget) -> bool:
    """Whether ``widget`` is drawn inside the terminal, where a click at its corner reaches it."""
    r = widget.region
    if not (r.width and r.height and 0 <= r.x < SIZE[0] and 0 <= r.y < SIZE[1]):
        return False
    return app.screen.get_widget_at(r.x, r.y)[0] is widget


def test_the_form_and_the_dialogs_fit_80x24(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    async def main():
        app = OsftTui(None)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: isinstance(app.screen, NewRunScreen), 10, "the form")
            seen = set()
            for _ in range(12):  # 9 fields, launch, cancel, back to the first
                await pilot.press("tab")
                await pilot.pause(0.05)
                assert on_screen(app, app.focused), app.focused
                seen.add(app.focused.id)
            assert {"launch", "cancel", "field-model", "field-extra_args"} <= seen
            await pilot.press("escape")
            await wait_until(pilot, lambda: not isinstance(app.screen, NewRunScreen), 10, "the dashboard")
            keys = {k.key for k in app.screen.query(FooterKey) if on_screen(app, k)}
            assert {"question_mark", "q"} <= keys, keys
            app.push_screen(Choice("a long question", [f"line {i}" for i in range(40)],
                                   [("yes", "yes", "primary"), ("no", "no", "default")]))
            await pilot.pause(0.3)
            assert all(on_screen(app, b) for b in app.screen.query(Button))
            app.pop_screen()
            await pilot.press("question_mark")
            await pilot.pause(0.3)
            assert all(on_screen(app, b) for b in app.screen.query(Button))

    asyncio.run(main())
