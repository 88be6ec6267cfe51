"""The protected-subspaces file's storage: float16 on disk, checked and re-orthonormalised on read."""

import math

import pytest
import torch
from osft.trainer.checkpoint.subspaces import (
    SUBSPACE_TOLERANCE_DEG,
    SUBSPACES_FILE,
    load_bases,
    read_bases,
    write_subspaces,
)
from osft.trainer.osft.protect import ModuleFold
from safetensors.torch import load_file, save_file


def _basis(n, p, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, p, generator=g, dtype=torch.float64))[0].float().contiguous()


def _largest_angle_deg(A, B):
    """Largest principal angle between the column spaces of orthonormal A and B (float64)."""
    cosines = torch.linalg.svdvals(A.double().t() @ B.double()).clamp(max=1.0)
    return math.degrees(math.acos(float(cosines.min())))


class _Fold:
    def __init__(self, P, Q):
        self.P, self.Q = P, Q

    def summary(self):
        return {"p_left": self.P.shape[-1], "p_right": self.Q.shape[-1]}


def test_bases_are_stored_in_half_the_bytes_and_read_back_within_the_stated_angle(tmp_path):
    P, Q = _basis(576, 200, 0), _basis(1536, 200, 1)
    bank_P, bank_Q = torch.stack([_basis(64, 8, s) for s in (2, 3)]), torch.stack([_basis(32, 8, s) for s in (4, 5)])
    assert hasattr(ModuleFold, "summary")
    write_subspaces(tmp_path, {"a": _Fold(P, Q), "bank": _Fold(bank_P, bank_Q)}, {"energy": 0.9}, {"step": 1})
    stored = load_file(tmp_path / SUBSPACES_FILE)
    assert {t.dtype for t in stored.values()} == {torch.float16}
    assert (tmp_path / SUBSPACES_FILE).stat().st_size < 0.51 * 4 * (P.numel() + Q.numel() + bank_P.numel() + bank_Q.numel())
    read = read_bases(tmp_path / SUBSPACES_FILE, {"a": (576, 1536), "bank": (2, 64, 32)})
    for (written, back) in ((P, read["a"][0]), (Q, read["a"][1]), (bank_P[1], read["bank"][0][1])):
        assert back.dtype == torch.float32
        eye = torch.eye(back.shape[-1], dtype=torch.float64)
        assert float((back.double().t() @ back.double() - eye).abs().max()) < 1e-6  # orthonormal again
        assert _largest_angle_deg(written, back) <= SUBSPACE_TOLERANCE_DEG
    assert _largest_angle_deg(P, read["a"][0]) > 1e-4  # float16 did round: the tolerance is not vacuous
    assert torch.equal(load_bases(tmp_path / SUBSPACES_FILE)["a.P"], read["a"][0])


@pytest.mark.parametrize("damage, message", [
    ("edited", "module a's P is not orthonormal"),
    ("bf16_values", "module a's P is not orthonormal"),
    ("bf16_dtype", "module a's P is stored as bfloat16"),
])
def test_an_edited_or_wrongly_rounded_basis_is_an_error_naming_module_and_file(tmp_path, damage, message):
    P, Q = _basis(576, 64, 0), _basis(576, 64, 1)
    if damage == "edited":
        P = P.half()
        P[10, 3] += 0.05
    elif damage == "bf16_values":  # float32 tensors holding bfloat16-rounded values
        P = P.bfloat16().float()
    else:
        P = P.bfloat16()
    path = tmp_path / SUBSPACES_FILE
    save_file({"a.P": P.contiguous(), "a.Q": Q.half().contiguous()}, str(path))
    with pytest.raises(ValueError, match=f"protected subspaces {path}: {message}"):
        read_bases(path, {"a": (576, 576)})
    save_file({"a.P": _basis(576, 64, 0).contiguous(), "a.Q": Q.contiguous()}, str(path))  # a float32 file as written before: accepted
    assert read_bases(path, {"a": (576, 576)})["a"][1].shape == (576, 64)
