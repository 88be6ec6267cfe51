"""The methods compared, and one training phase of one method (one task, from a dense model dir).

Every phase starts from a dense Hugging Face model directory and ends with one, so the two tasks
are learned one after the other the way a user would chain runs: task B starts from the model
exported after task A. For OSFT that means task B decomposes the weights left by task A (the
continual-learning recipe: what the model knows after A becomes the frozen high-rank subspace).

- ``osft`` and ``full_ft``: our trainer in this process (``Trainer.prepare()`` + ``Trainer.run()``,
  world size 1, exactly what ``osft-train`` runs on one rank), exporting float32.
- ``lora`` and ``peft_osf``: ``peft`` through :class:`peft_baselines.PeftTrainer` (our data, packing,
  loss, AdamW and schedule), adapters merged into a dense float32 model at the end of the phase.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("osft", "full_ft", "lora", "peft_osf")
#: Fields of each step record kept in the results (the same for our trainer and PEFT's).
STEP_KEYS = ("step", "loss", "lr", "num_tokens", "step_time_s")


@dataclass(frozen=True)
class Method:
    """One method of the comparison.

    Attributes:
        name: short id used in the JSON and on the plot, e.g. ``osft_urr0.25``.
        kind: one of :data:`KINDS`.
        urr: unfreeze rank ratio (``osft`` and ``peft_osf``).
        lora_rank: LoRA rank r (``lora``; alpha = 2r).
    """

    name: str
    kind: str
    urr: float | None = None
    lora_rank: int | None = None

    @property
    def label(self) -> str:
        """Human-readable name for tables and plots."""
        return {"osft": f"OSFT (ours), URR {self.urr}", "full_ft": "full fine-tuning (--no-osft)",
                "lora": f"LoRA r={self.lora_rank} (peft)", "peft_osf": f"PEFT OSF, URR {self.urr}"}[self.kind]


def make_methods(urrs: list[float], peft_urr: float, lora_rank: int, kinds: list[str] | None = None) -> list[Method]:
    """The sweep: OSFT at every URR of ``urrs``, full FT, LoRA, PEFT's OSF at ``peft_urr``
    (restricted to ``kinds`` when given)."""
    methods = [Method(f"osft_urr{u:g}", "osft", urr=u) for u in urrs]
    methods += [Method("full_ft", "full_ft"), Method(f"lora_r{lora_rank}", "lora", lora_rank=lora_rank),
                Method(f"peft_osf_urr{peft_urr:g}", "peft_osf", urr=peft_urr)]
    return [m for m in methods if kinds is None or m.kind in kinds]


@dataclass(frozen=True)
class Phase:
    """One task's training settings (the same for every method).

    Attributes:
        task: ``"A"`` or ``"B"``.
        data_path: chat jsonl to train on.
        steps: optimizer steps.
        batch_size: samples per step.
        max_seq_len: tokens per sample (longer samples are truncated).
        max_tokens: tokens per packed micro-batch.
        learning_rate / lr_scheduler / warmup_steps: AdamW schedule (as ``osft-train`` flags).
        seed: sampler and init seed.
    """

    task: str
    data_path: Path
    steps: int
    batch_size: int
    max_seq_len: int
    max_tokens: int
    learning_rate: float
    lr_scheduler: str
    warmup_steps: int
    seed: int


def _train_config(method: Method, phase: Phase, model_dir: Path, run_dir: Path, cache_dir: Path):
    from osft.trainer.config import TrainConfig, check_config

    cfg = TrainConfig(
        model_name_or_path=str(model_dir), data_path=str(phase.data_path), output_dir=str(run_dir),
        max_seq_len=phase.max_seq_len, overlong="truncate", batch_size=phase.batch_size,
        max_tokens_per_gpu=phase.max_tokens, learning_rate=phase.learning_rate, lr_scheduler=phase.lr_scheduler,
        warmup_steps=phase.warmup_steps, max_steps=phase.steps, seed=phase.seed, osft=method.kind == "osft",
        osft_unfreeze_rank_ratio=method.urr if method.urr is not None else 0.25,
        device="cpu", dtype="float32", save_dtype="float32", data_cache_dir=str(cache_dir),
    )  # fmt: skip
    check_config(cfg)
    return cfg


def _trainer_phase(method: Method, cfg) -> dict:
    from rich.console import Console

    from osft.trainer.loop import Trainer
    from osft.trainer.metrics import read_records
    from osft.trainer.rundir import RunDir

    start = time.perf_counter()
    trainer = Trainer(cfg, console=Console(stderr=True), job_id=f"continual-{method.name}")
    trainer.prepare()
    setup_s = time.perf_counter() - start
    svd_s = trainer.osft.svd_seconds if trainer.osft else None
    result = trainer.run()
    del trainer
    records = [r for f in sorted(RunDir(cfg.output_dir).metrics.glob("*.jsonl"))
               for r in read_records(f)[0] if r["event"] == "step"]
    return {"model_dir": Path(result.export_dir), "setup_s": setup_s, "svd_s": svd_s,
            "train_s": time.perf_counter() - start - setup_s, "ortho_violations": result.violations_total,
            "steps": [{k: r[k] for k in STEP_KEYS} for r in records]}


def _peft_phase(method: Method, cfg, out_dir: Path) -> dict:
    from peft_baselines import PeftTrainer, check_osf_split, lora_config, osf_config

    want = {}

    def make_config(model):
        if method.kind == "lora":
            return lora_config(method.lora_rank, 2 * method.lora_rank)
        config, split = osf_config(model, method.urr)
        want.update(split)
        return config

    start = time.perf_counter()
    trainer = PeftTrainer(cfg, make_config)
    if want:
        check_osf_split(trainer.model, want)
    setup_s = time.perf_counter() - start
    records = trainer.train()
    model_dir = trainer.save_merged(out_dir / "merged")
    wrap_s = trainer.wrap_s
    del trainer
    return {"model_dir": model_dir, "setup_s": setup_s, "svd_s": wrap_s if method.kind == "peft_osf" else None,
            "train_s": time.perf_counter() - start - setup_s, "ortho_violations": None,
            "steps": [{k: r[k] for k in STEP_KEYS} for r in records]}


def train_phase(method: Method, phase: Phase, model_dir: Path, out_dir: Path, cache_dir: Path) -> dict:
    """Train ``method`` on ``phase`` starting from the dense model in ``model_dir``.

    Returns:
        ``model_dir`` (the dense float32 result, under ``out_dir``), ``setup_s`` (s: load,
        tokenize, decompose), ``svd_s`` (s, OSFT and PEFT OSF), ``train_s`` (s: the steps and the
        export), ``ortho_violations`` (ours only) and ``steps`` (loss, lr, tokens, s per step).

    Raises:
        ValueError: an invalid setting (from the trainer's own config check).
    """
    cfg = _train_config(method, phase, model_dir, out_dir / "run", cache_dir)
    result = _peft_phase(method, cfg, out_dir) if method.kind in ("lora", "peft_osf") else _trainer_phase(method, cfg)
    gc.collect()
    return result
