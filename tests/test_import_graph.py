"""The floor plan has no circles: the import graph of ``osft.trainer`` and ``osft.tui``, read from
the sources with :mod:`ast`, is acyclic, counting every import (top level, inside functions and under
``TYPE_CHECKING``). See docs/architecture.md, section 2."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"osft.trainer": ROOT / "trainer", "osft.tui": ROOT / "tui"}


def _modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Every module of ``packages`` (dotted name -> folder) by dotted name (a package by its ``__init__.py``)."""
    found = {}
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The project modules one import statement names: ``from .a import b`` names ``a`` and, when
    it is a module, ``a.b``; ``import a.b`` names ``a.b``."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    out = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def import_graph(packages: dict[str, Path] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports anywhere in its source."""
    modules = _modules(packages)
    return {m: set().union(*(_imported(m, path, node, modules) for node in ast.walk(ast.parse(path.read_text()))
                             if isinstance(node, (ast.Import, ast.ImportFrom))))
            for m, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (or a self-import)."""
    found, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_cycles_finds_a_circle_and_its_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_reads_lazy_and_type_checking_imports(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name, text in {"__init__.py": "", "a.py": "def f():\n    from .sub import b\n",
                       "sub/__init__.py": "", "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n",
                       "c.py": "import pkg.sub.b\nfrom pkg import a\n"}.items():
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.sub.b", "pkg", "pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


@pytest.mark.parametrize("package", ["osft.trainer", "osft.tui"])
def test_no_import_cycles(package):
    graph = import_graph()
    found = [c for c in cycles(graph) if any(m.startswith(package + ".") for m in c)]
    assert found == [], f"import cycles: {found}"


@pytest.mark.subprocess
def test_a_launcher_starting_a_fresh_run_never_imports_the_checkpoint_library(tmp_path):
    """What ``osft-train`` does before it starts a fresh worker group (check for partial checkpoints
    and free space, validate and tokenize the data, check the subspaces and the Gram budget) loads
    no ``torch.distributed.checkpoint``: only a resume reads a checkpoint."""
    import subprocess
    import sys

    from helpers import QA, chat, save_tiny_model, write_jsonl

    model = save_tiny_model(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA])
    script = f"""
import sys
from pathlib import Path
from rich.console import Console
from osft.trainer.config import TrainConfig
from osft.trainer.launch.cli import _prepare_checkpoint_root
from osft.trainer.launch.launcher import preflight
cfg = TrainConfig({str(model)!r}, {str(data)!r}, {str(tmp_path / "run")!r}, batch_size=2, nproc_per_node=2,
                  data_cache=False)
console = Console(file=None, quiet=True)
assert _prepare_checkpoint_root(cfg, Path({str(tmp_path / "run" / "full_state_checkpoints")!r}), console) is None
preflight(cfg, console)
print(sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint")))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
