"""The numbers of each ``step`` metrics record: loss, throughput (job and node), MFU
(:class:`osft.trainer.observe.flops.Utilization`), memory (this process's, and on CUDA every GPU of
the node: :func:`gpu_sample`), and the orthogonality and forgetting fields.

The field names and their order are the record's contract (docs/architecture.md section 4; the
dashboard and ``tests/fake_trainer.py`` read them).
"""

from __future__ import annotations

import psutil
import torch

from ..contract import Event
from ..distributed import DistEnv, gather_float, gather_rows, node_ranks
from .flops import FlopModel, Utilization
from .matmul_peak import measure_matmul_peak
from .metrics import Reporter


def gpu_sample(device: torch.device, utilization: bool) -> tuple[int, float | None]:
    """This rank's GPU: the peak memory allocated by torch (bytes,
    ``torch.cuda.max_memory_allocated``) and, when ``utilization``, the device's utilisation over
    NVML's last sample period (percent, ``torch.cuda.utilization``; else None)."""
    util = float(torch.cuda.utilization(device)) if utilization else None
    return torch.cuda.max_memory_allocated(device), util


def nvml_readable(device: torch.device) -> str | None:
    """None when NVML reports ``device``'s utilisation, else why not (no ``nvidia-ml-py``, no
    driver access, a permission error: any failure of the first read)."""
    try:
        torch.cuda.utilization(device)
    except Exception as e:  # NVML's errors have no common base beside Exception
        return f"{type(e).__name__}: {e}"
    return None


class StepRecorder:
    """Builds and logs one rank's step records.

    Args:
        utilization: MFU against the GEMM peaks measured on every rank.
        node_of_rank: each global rank's node rank; ``node_rank``, ``local_rank``: this rank's.
        device: this rank's device (the CUDA memory high-water mark is recorded there).
    """

    def __init__(self, utilization: Utilization, node_of_rank: list[int], node_rank: int, local_rank: int,
                 device: torch.device, report: Reporter) -> None:
        self.utilization, self.node_of_rank, self.node_rank = utilization, node_of_rank, node_rank
        self.local_rank = local_rank
        why = nvml_readable(device) if device.type == "cuda" else "no CUDA device"
        self.nvml = why is None
        if device.type == "cuda" and why:
            report.say(f"GPU utilisation not recorded ({why}; pip install 'osft[gpu]')")
        self.device, self.report = device, report
        self._process = psutil.Process()

    @classmethod
    def measure(cls, flops: FlopModel, dist: DistEnv, device: torch.device, dtype: torch.dtype,
                report: Reporter) -> StepRecorder:
        """Measure this rank's GEMM peak (:func:`osft.trainer.observe.matmul_peak.measure_matmul_peak`), gather every
        rank's peak and node (collective) and say the job's peak."""
        node_of_rank = node_ranks(dist)
        peaks = gather_float(measure_matmul_peak(device, dtype))
        report.say(f"matmul peak measured: {sum(peaks) / 1e9:,.1f} GFLOP/s ({dtype}, {len(peaks)} rank(s)); "
                   f"model FLOPs per token {flops.dense_flops_per_token / 1e9:.3f} G + attention")
        return cls(Utilization(flops, tuple(peaks), tuple(node_of_rank), dist.node_rank), node_of_rank,
                   dist.node_rank, dist.local_rank, device, report)

    def fields(self, step: int, seconds: float, *, loss: float, grad_norm: float, lr: float,
               tokens_by_rank: list[int], loss_tokens: int, samples: int, lengths_by_rank: list,
               violations: int, max_dev: float | None, forgetting: dict) -> dict:
        """The numbers of step ``step``'s record, measured over ``seconds``: ``tokens_by_rank``
        (tokens each rank trained, by global rank), ``lengths_by_rank`` (their samples' lengths, for
        the model FLOPs), ``loss_tokens`` and ``samples`` of the global batch. Warns once when a
        step ran faster than the measured peak allows."""
        exceeded_before = self.utilization.peak_exceeded
        utilization = self.utilization.fields(lengths_by_rank, seconds)
        if self.utilization.peak_exceeded and not exceeded_before:
            self.report.warn(f"step {step} ran faster than the matmul peak measured at start-up allows "
                             f"({self.utilization.measured[0] / 1e9:,.1f} GFLOP/s): that measurement was disturbed; "
                             "MFU is taken against the fastest step from here on")
        global_tokens = sum(tokens_by_rank)
        node_tokens = sum(t for t, node in zip(tokens_by_rank, self.node_of_rank) if node == self.node_rank)
        return dict(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=global_tokens,
            num_loss_tokens=loss_tokens,
            num_samples=samples,
            step_time_s=seconds,
            tokens_per_s=global_tokens / seconds,
            node_tokens_per_s=node_tokens / seconds,
            samples_per_s=samples / seconds,
            **utilization,
            ortho_violations=violations,
            ortho_max_dev_deg=max_dev,
            **forgetting,
        )

    def log(self, step: int, epoch: int, violations_total: int, record: dict) -> None:
        """Log the ``step`` record: ``record`` (:meth:`fields` and what the loop adds) after the
        step, epoch, total violations and memory: this process's (``rss_bytes``; ``gpu_mem_bytes``,
        the CUDA peak, None on CPU) and, on CUDA, ``gpus``: every GPU of this node, one
        ``{"rank", "local_rank", "mem_bytes", "util_pct"}`` per rank in global rank order
        (:func:`gpu_sample`; None on CPU). On CUDA every rank calls it (one ``all_gather`` on the
        control group); only each node's local rank 0 writes."""
        gpus = mem = None
        if self.device.type == "cuda":
            mem, util = gpu_sample(self.device, self.nvml)
            rows = gather_rows([self.local_rank, mem, -1.0 if util is None else util])
            gpus = [{"rank": rank, "local_rank": int(local), "mem_bytes": int(m), "util_pct": None if u < 0 else u}
                    for rank, (local, m, u) in enumerate(rows) if self.node_of_rank[rank] == self.node_rank]
        self.report.log(
            Event.STEP, step=step, epoch=epoch, ortho_violations_total=violations_total,
            rss_bytes=self._process.memory_info().rss,
            gpu_mem_bytes=mem,
            gpus=gpus,
            **record,
        )
