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


def _section_params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, type]:
    """The parameters of ``node`` annotated with a section, by name."""
    return {a.arg: BY_NAME[ast.unparse(a.annotation)] for a in node.args.args + node.args.kwonlyargs
            if a.annotation is not None and ast.unparse(a.annotation) in BY_NAME}


def _bindings(node: ast.AST, sections: dict[str, type]) -> list[tuple[str, type]]:
    """``(target, section)`` for each plain assignment in ``node`` of a name in ``sections``
    (``self.cfg = cfg``, ``cfg = self.cfg``; tuples element by element); targets spelled as source."""
    found = []
    for n in ast.walk(node):
        if not isinstance(n, ast.Assign):
            continue
        for target in n.targets:
            pairs = (zip(target.elts, n.value.elts) if isinstance(target, ast.Tuple) and isinstance(n.value, ast.Tuple)
                     else [(target, n.value)])
            found += [(ast.unparse(t), sections[ast.unparse(v)]) for t, v in pairs if ast.unparse(v) in sections]
    return found


def _wrong_reads(node: ast.AST, sections: dict[str, type]) -> list[tuple[int, str, str]]:
    """``(line, section, attribute)`` for each read in ``node`` of ``<name>.<attribute>`` (``name``
    as source, ``cfg`` or ``self.cfg``) that the section bound to ``name`` does not have."""
    wrong = []
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and (name := ast.unparse(n.value)) in sections:
            if n.attr not in _names(sections[name]):
                wrong.append((n.lineno, sections[name].__name__, n.attr))
    return wrong


def section_reads(source: str) -> list[tuple[str, int, str, str]]:
    """``(function, line, section, attribute)`` for each read of an attribute that a parameter's
    section does not have, in the functions of ``source``; in a class, the sections its
    ``__init__`` keeps (``self.cfg = cfg``) are checked in every method, through local names too
    (``cfg = self.cfg``)."""
    tree = ast.parse(source)
    kept: dict[int, dict[str, type]] = {}  # id(method) -> the sections its class keeps on self
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            init = next((m for m in methods if m.name == "__init__"), None)
            on_self = dict(_bindings(init, _section_params(init))) if init else {}
            on_self = {k: v for k, v in on_self.items() if k.startswith("self.")}
            kept.update({id(m): on_self for m in methods})
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            sections = {**kept.get(id(node), {}), **_section_params(node)}
            sections.update(_bindings(node, sections))
            wrong += [(node.name, *w) for w in _wrong_reads(node, sections)]
    return wrong


def test_a_read_outside_the_declared_section_is_found():
    source = "def f(cfg: OptimizerConfig, other):\n    return cfg.learning_rate, cfg.data_path, other.data_path\n"
    assert section_reads(source) == [("f", 2, "OptimizerConfig", "data_path")]


def test_a_read_through_what_a_class_keeps_is_found():
    source = ("class C:\n    def __init__(self, cfg: OptimizerConfig, data: DataConfig):\n"
              "        self.cfg, self.n = cfg, 1\n        self.data = data\n"
              "    def f(self):\n        cfg = self.cfg\n        return cfg.seed, cfg.max_seq_len, self.data.seed\n"
              "    def g(self):\n        return self.cfg.learning_rate, self.cfg.output_dir\n")
    assert section_reads(source) == [("f", 7, "OptimizerConfig", "max_seq_len"), ("f", 7, "DataConfig", "seed"),
                                     ("g", 9, "OptimizerConfig", "output_dir")]


def test_components_that_take_a_section_read_only_its_settings():
    taking, wrong = [], []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        wrong += [(str(path.relative_to(ROOT)), *w) for w in section_reads(source)]
        taking += [path.name for name in BY_NAME if f": {name}" in source and path.name != "config.py"]
    assert not wrong, wrong
    assert len(taking) >= 3  # the check has something to check: components.py, build.py, startup.py
    assert all(isinstance(TrainConfig.__new__(TrainConfig), section) for section in SECTIONS)  # any run's config fits
