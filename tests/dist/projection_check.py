"""Run under torchrun: project gradients and parameters of FSDP2-sharded OSFT modules and write
the gathered results to a .pt file, for comparison with the single-process projection.

Usage: torchrun --nproc-per-node K projection_check.py OUT.pt

Each of the modes factored, gram and cached (factored with the gathered V bases kept) is checked;
so is ``map_over_ranks`` (which rank computed each of 7 items, as rank 0 receives them, and the
rounds its check saw on each rank).
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from osft.trainer.distributed import exit_rank, map_over_ranks, shutdown_distributed
from osft.trainer.osft.decomposition import OSFTLinear
from osft.trainer.osft.projection import Projector


def modules():
    """k_high = 7 in every module, stored as U_high or V_high (remove mode): 7 rows shard unevenly."""
    g = torch.Generator().manual_seed(0)
    specs = [(9, 10, 0.2), (23, 9, 0.2), (14, 20, 0.5), (20, 14, 0.5)]
    mods = []
    for n, m, urr in specs:
        mod = OSFTLinear.from_weight(torch.randn(n, m, generator=g), None, urr=urr, max_tokens_per_micro_batch=4)
        assert mod.V_basis.shape[0] == 7 or mod.U_basis.shape[1] == 7
        mod.U_low.grad = torch.randn(mod.U_low.shape, generator=g)
        mod.V_low.grad = torch.randn(mod.V_low.shape, generator=g)
        with torch.no_grad():
            mod.U_low.add_(0.1 * torch.randn(mod.U_low.shape, generator=g))
            mod.V_low.add_(0.1 * torch.randn(mod.V_low.shape, generator=g))
        mods.append(mod)
    return mods


def project(named, v_projection, cache):
    projector = Projector(named, v_projection, cache_v_basis=cache)
    projector.project_gradients()
    projector.project_parameters()
    projector.project_parameters()  # second call uses the cached bases when caching
    return projector.check(margin_deg=1.0), projector.deviation_bound()


def check(v_projection, cache):
    reference = modules()
    ref_report, ref_bound = project([(f"m{i}", m) for i, m in enumerate(reference)], v_projection, cache)
    sharded = modules()
    grads = [(m.U_low.grad, m.V_low.grad) for m in sharded]
    fully_shard(nn.Sequential(*sharded))  # one FSDP2 root over the modules
    for m, (gu, gv) in zip(sharded, grads):  # grads as FSDP would leave them: sharded like the params
        m.U_low.grad = distribute_tensor(gu, m.U_low.device_mesh, m.U_low.placements)
        m.V_low.grad = distribute_tensor(gv, m.V_low.device_mesh, m.V_low.placements)
    report, bound = project([(f"m{i}", m) for i, m in enumerate(sharded)], v_projection, cache)
    return {
        "diff": max(max((a.U_low.grad - b.U_low.grad.full_tensor()).abs().max().item(),
                        (a.V_low.grad - b.V_low.grad.full_tensor()).abs().max().item(),
                        (a.U_low - b.U_low.full_tensor()).abs().max().item(),
                        (a.V_low - b.V_low.full_tensor()).abs().max().item())
                    for a, b in zip(reference, sharded)),
        "max_dev_deg": report.max_dev_deg,
        "ref_max_dev_deg": ref_report.max_dev_deg,
        "bound_deg": bound,
        "ref_bound_deg": ref_bound,
        "local_rows": [m.V_basis.to_local().shape[0] for m in sharded] + [m.U_basis.to_local().shape[0] for m in sharded],
    }


def main():
    dist.init_process_group("gloo")
    result = {mode: check(v_projection, cache) for mode, (v_projection, cache) in
              {"factored": ("factored", False), "gram": ("gram", False), "cached": ("factored", True)}.items()}
    rank = dist.get_rank()
    rounds: list[int] = []
    result["mapped"] = map_over_ranks(lambda x: (x, dist.get_rank()), list(range(7)) if rank == 0 else None, 7,
                                      rounds.append)
    result["rounds"] = rounds
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        torch.save(gathered, sys.argv[1])
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_rank(0)
