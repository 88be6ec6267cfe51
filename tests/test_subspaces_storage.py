"""The protected-subspaces file's storage: 12-bit block codes on disk (float16 and float32 files of
before read alike), checked and re-orthonormalised on read."""

import math

import pytest
import torch
from osft.trainer.checkpoint import packed12
from osft.trainer.checkpoint.subspaces import (
    SUBSPACE_TOLERANCE_DEG,
    SUBSPACES_FILE,
    load_bases,
    read_bases,
    write_subspaces,
)
from osft.trainer.osft.protect import ModuleFold
from safetensors import safe_open
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


def test_bases_are_stored_in_1_53_bytes_an_entry_and_read_back_within_the_stated_angle(tmp_path):
    P, Q = _basis(576, 200, 0), _basis(1536, 200, 1)
    bank_P, bank_Q = torch.stack([_basis(64, 8, s) for s in (2, 3)]), torch.stack([_basis(32, 8, s) for s in (4, 5)])
    assert hasattr(ModuleFold, "summary")
    write_subspaces(tmp_path, {"a": _Fold(P, Q), "bank": _Fold(bank_P, bank_Q)}, {"energy": 0.9}, {"step": 1})
    stored = load_file(tmp_path / SUBSPACES_FILE)
    assert {t.dtype for t in stored.values()} == {torch.uint8, torch.float16}
    assert sorted(stored) == [f"{m}.{side}.{part}" for m in ("a", "bank") for side in "PQ" for part in ("codes", "scales")]
    with safe_open(str(tmp_path / SUBSPACES_FILE), framework="pt") as f:
        assert f.metadata() == {"osft_storage": "packed12", "a.P": "576,200", "a.Q": "1536,200", "bank.P": "2,64,8",
                                "bank.Q": "2,32,8"}
    entries = P.numel() + Q.numel() + bank_P.numel() + bank_Q.numel()
    payload = sum(t.numel() * t.element_size() for t in stored.values())
    assert payload == packed12.packed_bytes(576, 200) + packed12.packed_bytes(1536, 200) + \
        packed12.packed_bytes(64, 8, 2) + packed12.packed_bytes(32, 8, 2)
    assert payload == pytest.approx(1.53125 * entries, rel=0.01)  # 64-entry blocks: 96 bytes of codes + a scale
    read = read_bases(tmp_path / SUBSPACES_FILE, {"a": (576, 1536), "bank": (2, 64, 32)})
    for (written, back) in ((P, read["a"][0]), (Q, read["a"][1]), (bank_P[1], read["bank"][0][1])):
        assert back.dtype == torch.float32
        eye = torch.eye(back.shape[-1], dtype=torch.float64)
        assert float((back.double().t() @ back.double() - eye).abs().max()) < 1e-6  # orthonormal again
        assert _largest_angle_deg(written, back) <= SUBSPACE_TOLERANCE_DEG
        assert (back - written).abs().max() <= (1 + 2**-9) / (2 * packed12.LEVELS)  # no entry moved beyond half a step
    assert _largest_angle_deg(P, read["a"][0]) > 1e-4  # the codes did round: the tolerance is not vacuous
    assert torch.equal(load_bases(tmp_path / SUBSPACES_FILE)["a.P"], read["a"][0])


def test_a_file_of_before_holds_float16_bases_and_is_read_alike(tmp_path):
    P, Q = _basis(576, 64, 0), _basis(300, 64, 1)
    path = tmp_path / SUBSPACES_FILE
    save_file({"a.P": P.half().contiguous(), "a.Q": Q.half().contiguous()}, str(path))
    back = read_bases(path, {"a": (576, 300)})["a"]
    assert _largest_angle_deg(P, back[0]) <= SUBSPACE_TOLERANCE_DEG and _largest_angle_deg(Q, back[1]) <= SUBSPACE_TOLERANCE_DEG


def test_packed_codes_round_trip_any_shape_and_are_refused_for_another():
    for shape in ((100, 7), (3, 100, 7), (64, 1), (576, 0), (2, 65, 3)):
        B = torch.randn(shape, generator=torch.Generator().manual_seed(0)) / 10
        codes, scales = packed12.pack(B)
        back = packed12.unpack(codes, scales, shape)
        assert back.shape == B.shape
        scale = float(B.abs().amax()) * (1 + 2**-9) if B.numel() else 0  # a block's scale is at most this
        assert B.numel() == 0 or float((back - B).abs().max()) <= scale / (2 * packed12.LEVELS)
    with pytest.raises(ValueError, match="do not hold a 100×8 basis"):
        packed12.unpack(codes, scales, (100, 8))


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


@pytest.mark.parametrize("damage, message", [
    ("scale", "module a's P is not orthonormal"),
    ("codes", "module a's Q is not orthonormal"),
    ("shape", "a.P is not a packed basis with its shape in the metadata"),
])
def test_edited_codes_scales_or_shapes_are_an_error_naming_module_and_file(tmp_path, damage, message):
    write_subspaces(tmp_path, {"a": _Fold(_basis(576, 64, 0), _basis(576, 64, 1))}, {"energy": 0.9}, {"step": 1})
    path = tmp_path / SUBSPACES_FILE
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    if damage == "scale":
        tensors["a.P.scales"][3] *= 1.5
    elif damage == "codes":
        tensors["a.Q.codes"][5, :12] = 255
    else:
        meta["a.P"] = "576,63"
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=f"protected subspaces {path}: {message}"):
        read_bases(path, {"a": (576, 576)})
