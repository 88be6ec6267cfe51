"""The protected-subspaces file of an HF export: ``osft_subspaces.safetensors`` + ``osft_subspaces.json``.

The safetensors file holds, per OSFT target, ``<module name>.P`` (N×p_L) and ``<module name>.Q``
(M×p_R), orthonormal columns stored as float16 (:data:`STORAGE_DTYPE`; files written
before hold float32, read alike): the directions earlier OSFT runs changed (see
:mod:`..osft.protect`); for an expert bank (``<experts>.gate_proj``) one basis per expert, E×N×p and
E×M×p with one p per bank (:func:`..osft.protect.fold_bank`). The JSON file describes them: format version, τ (``energy``), cap
(``max_rank_ratio``), variant (``basis``), the run they came from, and per module p_L, p_R, the
directions added by that run, the energy kept and whether the cap bound. A run whose
``--model-name-or-path`` is such an export protects these subspaces (``--osft-protect-subspaces``).

Storage: the entries of an orthonormal basis lie in [-1, 1], where float16 keeps 11 significant
bits, so a basis costs half its float32 size. Reading checks each basis (finite, float16 or float32,
every entry of BᵀB − I within :func:`orthonormality_tolerance` of its dtype: a hand-edited file, or
one cast to bfloat16 or rounded like it, is an error naming the module and the file) and then
re-orthonormalises it in float64 (B·(BᵀB)^(-1/2), the orthonormal basis nearest to B). The subspace
read back differs from the one written by a largest principal angle of at most
:data:`SUBSPACE_TOLERANCE_DEG` (tests/test_subspaces_storage.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..osft.protect import ModuleFold

SUBSPACES_FILE = "osft_subspaces.safetensors"
SUBSPACES_JSON = "osft_subspaces.json"
FORMAT_VERSION = 1
#: The dtype the bases are written in.
STORAGE_DTYPE = torch.float16
#: Largest principal angle (degrees) between a written subspace and the one read back.
SUBSPACE_TOLERANCE_DEG = 0.1
_UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def orthonormality_tolerance(dtype: torch.dtype) -> float:
    """Largest ``|BᵀB − I|`` entry accepted for a basis stored in ``dtype``: twice its unit roundoff
    (the most rounding each entry to ``dtype`` can add to an exactly orthonormal basis) plus 2e-5
    for the float32 arithmetic that made the basis."""
    return 2 * _UNIT_ROUNDOFF[dtype] + 2e-5


def _orthonormalized(B: torch.Tensor, path: Path, key: str) -> torch.Tensor:
    """``B`` (…×n×p) checked and re-orthonormalised (see the module docstring), float32."""
    if B.dtype not in _UNIT_ROUNDOFF:
        raise ValueError(f"protected subspaces {path}: {key} is stored as {str(B.dtype).removeprefix('torch.')}, "
                         "expected float16 or float32 (a basis rounded to another type is no longer orthonormal)")
    if B.shape[-1] == 0:
        return B.float()
    if not torch.isfinite(B).all():
        raise ValueError(f"protected subspaces {path}: {key} holds non-finite values")
    X = B.double()
    G = X.transpose(-1, -2) @ X
    eye = torch.eye(G.shape[-1], dtype=G.dtype)
    worst = float((G - eye).abs().max())
    tol = orthonormality_tolerance(B.dtype)
    if worst > tol:
        raise ValueError(f"protected subspaces {path}: {key} is not orthonormal: an entry of its BᵀB − I is "
                         f"{worst:.2e}, more than {tol:.1e} for a {str(B.dtype).removeprefix('torch.')} basis "
                         "(the file was edited or rounded; re-export it from the run that wrote it)")
    evals, evecs = torch.linalg.eigh(G)
    return (X @ (evecs * evals.rsqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)).float()


def subspaces_file(model_path: str | Path) -> Path | None:
    """``model_path/osft_subspaces.safetensors`` when ``model_path`` is a directory holding one."""
    path = Path(model_path) / SUBSPACES_FILE
    return path if path.is_file() else None


def read_bases(path: Path, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Read a subspaces file and check it against the model's OSFT targets.

    Args:
        path: an ``osft_subspaces.safetensors``.
        shapes: (N, M) of every target of the model being trained, (E, N, M) of an expert bank, by
            module name.

    Returns:
        (P: N×p_L, Q: M×p_R) float32 per module named in the file (E×N×p, E×M×p for a bank),
        re-orthonormalised.

    Raises:
        ValueError: naming the file and the module: an unreadable file, a tensor that is not
            ``<module>.P``/``<module>.Q``, a module without both, a module that is not a target of
            this model, or bases whose leading dimensions differ from the target's (E,) N (P) or
            (E,) M (Q), or a bank's P and Q of different ranks, or a basis that is not
            orthonormal to its dtype's tolerance or not stored as float16/float32.
    """
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a corrupt file
        raise ValueError(f"protected subspaces {path}: cannot read it: {exc}") from exc
    bases: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, _, side = key.rpartition(".")
        if side not in ("P", "Q") or tensor.dim() not in (2, 3):
            raise ValueError(f"protected subspaces {path}: tensor {key!r} is not a 2-D (3-D for an expert bank) "
                             "<module>.P or <module>.Q")
        bases.setdefault(name, {})[side] = tensor
    out = {}
    for name, sides in sorted(bases.items()):
        if set(sides) != {"P", "Q"}:
            raise ValueError(f"protected subspaces {path}: module {name} has only {'/'.join(sides)}, needs P and Q")
        if name not in shapes:
            raise ValueError(f"protected subspaces {path}: module {name} is not an OSFT target of this model")
        shape, P, Q = tuple(shapes[name]), sides["P"], sides["Q"]
        lead, (n, m) = shape[:-2], shape[-2:]
        if (P.shape[:-1] != lead + (n,) or Q.shape[:-1] != lead + (m,) or P.shape[-1] > n or Q.shape[-1] > m
                or (lead and P.shape[-1] != Q.shape[-1])):
            want = f"{'×'.join(map(str, lead + (n,)))}×p_L and {'×'.join(map(str, lead + (m,)))}×p_R"
            raise ValueError(f"protected subspaces {path}: module {name} is {'×'.join(map(str, shape))}, but its P is "
                             f"{tuple(P.shape)} and its Q {tuple(Q.shape)} (expected {want}"
                             f"{', p_L = p_R for an expert bank' if lead else ''})")
        out[name] = (_orthonormalized(P, path, f"module {name}'s P"), _orthonormalized(Q, path, f"module {name}'s Q"))
    return out


def write_subspaces(directory: Path, folds: Mapping[str, ModuleFold], settings: dict, source: dict) -> None:
    """Write ``osft_subspaces.safetensors`` and ``osft_subspaces.json`` into ``directory``.

    Args:
        folds: every OSFT module's protected bases after this run.
        settings: ``energy`` (τ), ``max_rank_ratio`` (cap), ``basis`` and, for ``inputs``,
            ``input_energy`` (ε) and ``input_samples``.
        source: the run the bases came from (``output_dir``, ``job_id``, ``step``).
    """
    tensors = {}
    for name, fold in folds.items():
        tensors[f"{name}.P"] = fold.P.to(STORAGE_DTYPE).contiguous()
        tensors[f"{name}.Q"] = fold.Q.to(STORAGE_DTYPE).contiguous()
    save_file(tensors, str(Path(directory) / SUBSPACES_FILE))
    meta = {"format_version": FORMAT_VERSION, **settings, "source": source,
            "modules": {name: fold.summary() for name, fold in folds.items()}}
    (Path(directory) / SUBSPACES_JSON).write_text(json.dumps(meta, indent=1))


def load_bases(path: Path) -> dict[str, torch.Tensor]:
    """Every basis of a subspaces file by its key (``<module>.P``, ``<module>.Q``), checked and
    re-orthonormalised as :func:`read_bases` does (float32), without a model to check shapes against.

    Raises:
        ValueError: an unreadable file, or a basis :func:`read_bases` refuses for its values.
    """
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a corrupt file
        raise ValueError(f"protected subspaces {path}: cannot read it: {exc}") from exc
    return {key: _orthonormalized(tensor, path, key) for key, tensor in tensors.items()}
