"""A component that declares the config section it takes (``cfg: OptimizerConfig``, not the whole
``TrainConfig``) reads only that section's settings: checked in the sources with :mod:`ast`, for
every function of ``osft.trainer`` with a parameter annotated with a section. See
docs/architecture.md, the row of ``trainer/config.py``."""

from __future__ import annotations

import ast
from pathlib import Path

from osft.trainer.config import SECTIONS, TrainConfig

ROOT = Path(__file__).resolve().parents[1] / "trainer"
BY_NAME = {section.__name__: section for section in SECTIONS}


def _names(section: type) -> set[str]:
    """What an object of ``section`` offers: its fields and class attributes."""
    return set(section.__annotations__) | {name for name in vars(section) if not name.startswith("_")}


def section_reads(source: str) -> list[tuple[str, int, str, str]]:
    """``(function, line, section, attribute)`` for each read of an attribute that a parameter's
    section does not have, in the functions of ``source``."""
    wrong = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        params = {a.arg: BY_NAME[ast.unparse(a.annotation)] for a in node.args.args + node.args.kwonlyargs
                  if a.annotation is not None and ast.unparse(a.annotation) in BY_NAME}
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in params:
                section = params[n.value.id]
                if n.attr not in _names(section):
                    wrong.append((node.name, n.lineno, section.__name__, n.attr))
    return wrong


def test_a_read_outside_the_declared_section_is_found():
    source = "def f(cfg: OptimizerConfig, other):\n    return cfg.learning_rate, cfg.data_path, other.data_path\n"
    assert section_reads(source) == [("f", 2, "OptimizerConfig", "data_path")]


def test_components_that_take_a_section_read_only_its_settings():
    taking, wrong = [], []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        wrong += [(str(path.relative_to(ROOT)), *w) for w in section_reads(source)]
        taking += [path.name for name in BY_NAME if f": {name}" in source and path.name != "config.py"]
    assert not wrong, wrong
    assert len(taking) >= 3  # the check has something to check: components.py, build.py, startup.py
    assert all(isinstance(TrainConfig.__new__(TrainConfig), section) for section in SECTIONS)  # any run's config fits
