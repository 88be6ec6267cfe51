"""Helpers for the osft-tui tests: waiting on a live app, and cleaning up after a run."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil


async def wait_until(pilot, predicate, timeout: float, what: str, step: float = 0.2):
    """Let the app run until ``predicate()`` is truthy; return its value. Fails the test after
    ``timeout`` seconds with ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(step)


def processes_of(out, readers: bool = False) -> list[psutil.Process]:
    """Live processes whose command line mentions the run directory ``out`` (without the
    dashboard's own reader process unless ``readers``)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
            if not readers and "osft.tui.reader" in cmdline:
                continue
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(out) in cmdline:
                found.append(p)
        except psutil.Error:
            continue
    return found


def kill_run(out) -> None:
    """SIGKILL every process that mentions ``out`` (cleanup after a failed test)."""
    for p in processes_of(out, readers=True):
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def no_processes_left(out, timeout: float = 30.0) -> bool:
    """Wait until no process mentions ``out``; True if none is left in time."""
    deadline = time.monotonic() + timeout
    while processes_of(out):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


def screen_text(app) -> str:
    """The plain text of the screen on top, as the terminal would show it (one line per row)."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())
