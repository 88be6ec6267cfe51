"""The demo assets as the benchmarks find them."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def demo_assets(demo_dir: str | Path | None):
    """SmolLM2-135M-Instruct and the chit-chat data (``osft.trainer.tools.demo_assets.DemoAssets``).

    Looked up in ``demo_dir``, else ``$OSFT_DEMO_DIR``, else the test suite's cache
    (``.pytest_cache/d/osft-demo``) when complete, else ``fetch_demo()``'s default location; fetched
    there when missing.

    Raises:
        DemoFetchError: the assets are missing and cannot be downloaded.
    """
    from osft.trainer.tools.demo_assets import fetch_demo

    if demo_dir is None and not os.environ.get("OSFT_DEMO_DIR"):
        cached = REPO / ".pytest_cache" / "d" / "osft-demo"  # where the test suite keeps them
        demo_dir = cached if (cached / ".complete").exists() else None
    return fetch_demo(Path(demo_dir) if demo_dir else None)
