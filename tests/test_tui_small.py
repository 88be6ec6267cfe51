"""osft-tui at 80x24: every field and button of the new-run form can be reached with Tab
and is on screen when focused, dialogs keep their buttons on screen and answer single keys, the help
text wraps to its dialog, the command palette has one entry per command, the button row can be
hidden, and the footer always shows ?, q and ^p."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

from osft.tui import request_flow
from osft.tui.app import OsftTui
from osft.tui.components.modals import Choice, HelpScreen
from osft.tui.components.new_run import NewRunScreen
from textual.command import CommandList, CommandPalette
from textual.geometry import Region
from textual.widgets import Button, Static
from textual.widgets._footer import FooterKey
from textual.widgets._toast import Toast
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


def on_dashboard(tmp_path, monkeypatch, check, notifications: bool = False) -> None:
    """Run ``await check(app, pilot)`` on a dashboard without a run at 80x24, its new-run form closed
    (with ``notifications``, toasts are drawn)."""
    monkeypatch.chdir(tmp_path)

    async def main():
        app = OsftTui(None)
        async with app.run_test(size=SIZE, notifications=notifications) as pilot:
            await wait_until(pilot, lambda: isinstance(app.screen, NewRunScreen), 10, "the form")
            await pilot.press("escape")
            await wait_until(pilot, lambda: app.screen is app.dashboard, 10, "the dashboard")
            await check(app, pilot)

    asyncio.run(main())


def test_the_palette_lists_each_command_once_without_markup(tmp_path, monkeypatch):
    async def check(app, pilot):
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette)
                         and app.screen.query_one(CommandList).option_count, 10, "the palette")
        entries = [str(o.prompt) for o in app.screen.query_one(CommandList).options]
        titles = [e.split("\n")[0] for e in entries]
        assert len(titles) == len(set(titles)), titles
        assert {"Quit", "Help", "Checkpoint"} <= set(titles) and "Keys" not in titles, titles
        assert not [e for e in entries if re.search(r"``|:(meth|data|class|attr):", e)], entries

    on_dashboard(tmp_path, monkeypatch, check)


def test_the_help_text_wraps_to_its_dialog(tmp_path, monkeypatch):
    """No line of the help could have held the next line's first word: the text is wrapped where
    the dialog ends, not where an earlier, wider layout ended."""
    async def check(app, pilot):
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), 10, "the help")
        await pilot.pause(0.3)
        texts = list(app.screen.query(Static).exclude("Button"))
        assert any("control/checkpoint" in str(t.render()) for t in texts)
        for text in texts:
            width = text.content_size.width
            lines = [s.text.rstrip() for s in text.render_lines(Region(0, 0, *text.content_size))]
            for line, after in zip(lines, lines[1:]):
                if line.strip() and after.strip():
                    assert len(line) + 1 + len(after.split()[0]) > width, (line, after, width)
        # closed and opened again: the same screen, not a new one built (its building was most of
        # a press's latency under a flood, bench_tui)
        first = app.screen
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen), 10, "the help to close")
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), 10, "the help again")
        assert app.screen is first

    on_dashboard(tmp_path, monkeypatch, check)


def test_dialogs_answer_single_keys_shown_on_their_buttons(tmp_path, monkeypatch):
    """The quit dialog (detach d, cancel c; checkpoint and stop and kill only by Enter on their
    button) and the kill confirmation (cancel c, kill y) of a run that looks alive: the key that
    opened a dialog, or another dashboard key, never answers one that acts; kill reaches no real process."""
    killed = []
    monkeypatch.setattr(request_flow, "kill_processes", lambda targets: killed.append(targets) or [])
    target = SimpleNamespace(pid=4242, role="launcher of node 0")

    async def check(app, pilot):
        app.dashboard.view = SimpleNamespace(any_alive=lambda: True, kill_targets=lambda: [target])
        await pilot.press("q")
        await wait_until(pilot, lambda: isinstance(app.screen, Choice), 10, "the quit dialog")
        labels = [str(b.label) for b in app.screen.query(Button)]
        assert labels == ["detach (d)", "checkpoint and stop", "kill", "cancel (c)"], labels
        await pilot.pause(0.2)
        inside = app.screen.query_one(".dialog").content_region
        assert all(inside.contains_region(b.region) for b in app.screen.query(Button))  # whole, at 80 columns
        app.dashboard.notify("a toast while the dialog is open")
        await pilot.pause(0.2)
        toasts = app.screen.query(Toast)
        assert toasts and not [t for t in toasts if t.region.area]  # held back: it never covers the answers
        await pilot.press("q", "k", "s", "y")
        await pilot.pause(0.2)
        assert isinstance(app.screen, Choice) and not killed
        await pilot.press("c")
        await wait_until(pilot, lambda: app.screen is app.dashboard, 10, "the dashboard again")
        await pilot.press("K")
        await wait_until(pilot, lambda: isinstance(app.screen, Choice), 10, "the kill confirmation")
        assert [str(b.label) for b in app.screen.query(Button)] == ["cancel (c)", "kill (y)"]
        await pilot.press("K", "k")
        await pilot.pause(0.2)
        assert isinstance(app.screen, Choice) and not killed
        await pilot.press("y")
        await wait_until(pilot, lambda: killed, 10, "the kill")
        assert killed == [[target]] and app.screen is app.dashboard
        await pilot.pause(0.5)  # q again, not an auto-repeat
        await pilot.press("q")
        await wait_until(pilot, lambda: isinstance(app.screen, Choice), 10, "the quit dialog")
        await pilot.press("d")
        await wait_until(pilot, lambda: app.return_value == 0, 10, "detach")

    on_dashboard(tmp_path, monkeypatch, check, notifications=True)
    assert killed == [[target]]


def test_b_hides_the_button_row_and_the_footer_keeps_help_quit_and_palette(tmp_path, monkeypatch):
    async def check(app, pilot):
        row, events, middle = app.screen.query_one("#buttons"), app.screen.query_one("#events"), app.screen.query_one("#middle")

        def below_charts() -> int:  # the checkpoint and rank panes and the events share the rest (1fr each)
            return middle.size.height + events.size.height

        height = below_charts()
        assert row.display and on_screen(app, row.query(Button).first())
        await pilot.press("b")
        await wait_until(pilot, lambda: below_charts() == height + 1, 10, "the panes taking the row")
        assert not row.display
        keys = {k.key for k in app.screen.query(FooterKey) if on_screen(app, k)}
        assert {"question_mark", "q", "ctrl+p"} <= keys, keys
        await pilot.press("b")
        await wait_until(pilot, lambda: row.display and below_charts() == height, 10, "the row back")

    on_dashboard(tmp_path, monkeypatch, check)


def test_the_theme_chosen_is_kept_for_the_next_session(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))

    async def session(choose: str | None) -> str:
        app = OsftTui(None, readonly=True)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            if choose:
                app.theme = choose
                await pilot.pause()
            return app.theme

    assert asyncio.run(session(None)) == "textual-dark"
    assert asyncio.run(session("nord")) == "nord"
    assert asyncio.run(session(None)) == "nord"
    assert json.loads((tmp_path / "config" / "osft-tui" / "settings.json").read_text()) == {"theme": "nord"}


def test_the_footer_is_rebuilt_only_when_its_keys_change():
    """``KeyFooter``: closing the help (the screen's bindings signal fires again) keeps the same key
    widgets; a key whose action becomes disabled rebuilds them, showing it disabled."""
    from osft.tui.components.footer import KeyFooter
    from textual.app import App
    from textual.binding import Binding

    class Keys(App):
        BINDINGS = [Binding("x", "act", "act"), Binding("question_mark", "help", "help")]
        allowed = True

        def compose(self):
            yield KeyFooter()

        def check_action(self, action, parameters):
            return True if action != "act" or self.allowed else None  # None: shown, disabled

        def action_help(self):
            self.push_screen(HelpScreen([("x", "act")], []))

    async def main():
        app = Keys()
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            footer = app.screen.query_one(KeyFooter)
            before = list(footer.query(FooterKey))
            assert [k.key for k in before] == ["x", "question_mark", "ctrl+p"]
            await pilot.press("question_mark")
            await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), 5, "the help")
            await pilot.press("escape")
            await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen), 5, "the help closed")
            await pilot.pause(0.2)
            assert list(footer.query(FooterKey)) == before  # the same widgets: not rebuilt
            app.allowed = False
            app.refresh_bindings()
            await wait_until(pilot, lambda: list(footer.query(FooterKey)) != before, 5, "a rebuilt footer")
            assert [k.has_class("-disabled") for k in footer.query(FooterKey)] == [True, False, False]

    asyncio.run(main())
