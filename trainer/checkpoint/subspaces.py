"""The protected-subspaces file of an HF export: ``osft_subspaces.safetensors`` + ``osft_subspaces.json``.

The safetensors file holds, per OSFT target, the bases ``<module name>.P`` (N×p_L) and
``<module name>.Q`` (M×p_R) with orthonormal columns: the directions earlier OSFT runs changed (see
:mod:`..osft.protect`); for an expert bank (``<experts>.gate_proj``) one basis per expert, E×N×p and
E×M×p with one p per bank (:func:`..osft.protect.fold_bank`). The JSON file describes them: format version, τ (``energy``), cap
(``max_rank_ratio``), variant (``basis``), the run they came from, and per module p_L, p_R, the
directions added by that run, the energy kept and whether the cap bound. A run whose
``--model-name-or-path`` is such an export protects these subspaces (``--osft-protect-subspaces``).

Storage (:data:`STORAGE`, in the file's metadata): each basis as 12-bit block codes
(:mod:`.packed12`: tensors ``<key>.codes`` and ``<key>.scales``, its shape in the metadata under
``<key>``), 1.53 bytes per entry; files written before hold each basis as one float16 or float32
tensor ``<key>`` and are read alike. Reading checks each basis (finite, stored in one of these
forms, every entry of BᵀB − I within :func:`orthonormality_tolerance` of its storage: a
hand-edited file, or one cast to bfloat16 or rounded like it, is an error naming the module and
the file) and then re-orthonormalises it in float64 (B·(BᵀB)^(-1/2), the orthonormal basis nearest
to B). The subspace read back differs from the one written by a largest principal angle of at most
:data:`SUBSPACE_TOLERANCE_DEG` (tests/test_subspaces_storage.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..osft.protect import ModuleFold
from . import packed12

SUBSPACES_FILE = "osft_subspaces.safetensors"
SUBSPACES_JSON = "osft_subspaces.json"
FORMAT_VERSION = 2
#: The metadata key of the storage, and the storage the bases are written in.
STORAGE_KEY, STORAGE = "osft_storage", "packed12"
#: Largest principal angle (degrees) between a written subspace and the one read back.
SUBSPACE_TOLERANCE_DEG = 0.1
#: The most storing can move an entry e of an orthonormal basis, per storage: a share of |e|
#: (float16, float32: the unit roundoff) or of its block's scale (``packed12``).
_ROUNDING = {"float16": 2.0**-11, "float32": 2.0**-24, STORAGE: 1 / (2 * packed12.LEVELS)}


def orthonormality_tolerance(storage: str) -> float:
    """Largest ``|BᵀB − I|`` entry accepted for a basis stored as ``storage`` (``float16``,
    ``float32`` or ``packed12``): twice the most storing can add to an exactly orthonormal basis
    (for ``packed12`` with every entry moved by up to its block's scale s_b ≤ ‖block‖, so that
    Σ_k |x_k| |e_k| ≤ √BLOCK / (2·LEVELS)) plus 2e-5 for the float32 arithmetic that made it."""
    spread = math.sqrt(packed12.BLOCK) if storage == STORAGE else 1.0
    return 2 * spread * _ROUNDING[storage] + 2e-5


def _orthonormalized(B: torch.Tensor, storage: str, path: Path, key: str) -> torch.Tensor:
    """``B`` (…×n×p, as read from ``storage``) checked and re-orthonormalised (see the module
    docstring), float32."""
    if B.shape[-1] == 0:
        return B.float()
    if not torch.isfinite(B).all():
        raise ValueError(f"protected subspaces {path}: {key} holds non-finite values")
    X = B.double()
    G = X.transpose(-1, -2) @ X
    eye = torch.eye(G.shape[-1], dtype=G.dtype)
    worst = float((G - eye).abs().max())
    tol = orthonormality_tolerance(storage)
    if worst > tol:
        raise ValueError(f"protected subspaces {path}: {key} is not orthonormal: an entry of its BᵀB − I is "
                         f"{worst:.2e}, more than {tol:.1e} for a {storage} basis "
                         "(the file was edited or rounded; re-export it from the run that wrote it)")
    evals, evecs = torch.linalg.eigh(G)
    return (X @ (evecs * evals.rsqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)).float()


def _stored(path: Path) -> dict[str, tuple[torch.Tensor, str]]:
    """Every basis of a subspaces file by its key (``<module>.P``), with the storage it was read
    from: unpacked from ``packed12`` codes, or a float16/float32 tensor of a file written before.

    Raises:
        ValueError: naming the file: unreadable, a basis stored as another dtype, or codes that
            do not hold the shape the metadata gives.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            meta, tensors = f.metadata() or {}, {key: f.get_tensor(key) for key in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for a corrupt file
        raise ValueError(f"protected subspaces {path}: cannot read it: {exc}") from exc
    if meta.get(STORAGE_KEY) != STORAGE:
        for key, B in tensors.items():
            if B.dtype not in (torch.float16, torch.float32):
                name, _, side = key.rpartition(".")
                raise ValueError(f"protected subspaces {path}: module {name}'s {side} is stored as "
                                 f"{str(B.dtype).removeprefix('torch.')}, "
                                 "expected float16 or float32 (a basis rounded to another type is no longer orthonormal)")
        return {key: (B, str(B.dtype).removeprefix("torch.")) for key, B in tensors.items()}
    out = {}
    for key in sorted({k.rpartition(".")[0] for k in tensors}):
        try:
            shape = tuple(int(d) for d in meta[key].split(","))
            out[key] = (packed12.unpack(tensors[f"{key}.codes"], tensors[f"{key}.scales"], shape), STORAGE)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"protected subspaces {path}: {key} is not a packed basis with its shape in the "
                             f"metadata: {exc}") from exc
    return out


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
            orthonormal to its storage's tolerance or not stored in one of the forms above.
    """
    bases: dict[str, dict[str, tuple[torch.Tensor, str]]] = {}
    for key, stored in _stored(path).items():
        name, _, side = key.rpartition(".")
        if side not in ("P", "Q") or stored[0].dim() not in (2, 3):
            raise ValueError(f"protected subspaces {path}: tensor {key!r} is not a 2-D (3-D for an expert bank) "
                             "<module>.P or <module>.Q")
        bases.setdefault(name, {})[side] = stored
    out = {}
    for name, sides in sorted(bases.items()):
        if set(sides) != {"P", "Q"}:
            raise ValueError(f"protected subspaces {path}: module {name} has only {'/'.join(sides)}, needs P and Q")
        if name not in shapes:
            raise ValueError(f"protected subspaces {path}: module {name} is not an OSFT target of this model")
        shape, (P, p_storage), (Q, q_storage) = tuple(shapes[name]), sides["P"], sides["Q"]
        lead, (n, m) = shape[:-2], shape[-2:]
        if (P.shape[:-1] != lead + (n,) or Q.shape[:-1] != lead + (m,) or P.shape[-1] > n or Q.shape[-1] > m
                or (lead and P.shape[-1] != Q.shape[-1])):
            want = f"{'×'.join(map(str, lead + (n,)))}×p_L and {'×'.join(map(str, lead + (m,)))}×p_R"
            raise ValueError(f"protected subspaces {path}: module {name} is {'×'.join(map(str, shape))}, but its P is "
                             f"{tuple(P.shape)} and its Q {tuple(Q.shape)} (expected {want}"
                             f"{', p_L = p_R for an expert bank' if lead else ''})")
        out[name] = (_orthonormalized(P, p_storage, path, f"module {name}'s P"),
                     _orthonormalized(Q, q_storage, path, f"module {name}'s Q"))
    return out


def write_subspaces(directory: Path, folds: Mapping[str, ModuleFold], settings: dict, source: dict) -> None:
    """Write ``osft_subspaces.safetensors`` and ``osft_subspaces.json`` into ``directory``.

    Args:
        folds: every OSFT module's protected bases after this run.
        settings: ``energy`` (τ), ``max_rank_ratio`` (cap), ``basis`` and, for ``inputs``,
            ``input_energy`` (ε) and ``input_samples``.
        source: the run the bases came from (``output_dir``, ``job_id``, ``step``).
    """
    tensors, meta = {}, {STORAGE_KEY: STORAGE}
    for name, fold in folds.items():
        for side, B in (("P", fold.P), ("Q", fold.Q)):
            key = f"{name}.{side}"
            tensors[f"{key}.codes"], tensors[f"{key}.scales"] = packed12.pack(B)
            meta[key] = ",".join(map(str, B.shape))
    save_file(tensors, str(Path(directory) / SUBSPACES_FILE), metadata=meta)
    meta = {"format_version": FORMAT_VERSION, **settings, "source": source,
            "modules": {name: fold.summary() for name, fold in folds.items()}}
    (Path(directory) / SUBSPACES_JSON).write_text(json.dumps(meta, indent=1))


def load_bases(path: Path) -> dict[str, torch.Tensor]:
    """Every basis of a subspaces file by its key (``<module>.P``, ``<module>.Q``), checked and
    re-orthonormalised as :func:`read_bases` does (float32), without a model to check shapes against.

    Raises:
        ValueError: an unreadable file, or a basis :func:`read_bases` refuses for its values.
    """
    return {key: _orthonormalized(B, storage, path, key) for key, (B, storage) in _stored(path).items()}
