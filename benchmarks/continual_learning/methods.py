"""The arms compared and one training phase (one task, from a dense model directory).

Every phase starts from a dense Hugging Face model directory and ends with one, so the two tasks
are learned one after the other the way a user chains runs: task B starts from the model exported
after task A. Arms that start from the same task-A run share it (:data:`TASK_A_RUNS`, run once per
seed); an arm (:data:`ARMS`) is a task-A run plus task B's settings. Both tables are data: a run or
an arm is its ``TrainConfig`` fields (as ``osft-train`` flags set them) and a learning rate.

- ``trainer`` phases: our trainer in this process (``Trainer.prepare()`` + ``Trainer.run()``, world
  size 1, exactly what ``osft-train`` runs on one rank), exporting float32;
- ``peft_osf`` phases: PEFT's own OSF (``OSFConfig`` at our rank split) through
  :class:`peft_baselines.PeftTrainer` (our data, packing, loss, AdamW and schedule), merged into a
  dense float32 model at the end of the phase.

Learning rates: task A at one rate per method (:data:`TASK_A_RUNS`), task B per arm (:data:`ARMS`);
``continual.py --pilot`` chooses task B's so that every arm learns B about as much as full
fine-tuning does. Task A: 5e-5 for every method (10 steps of 8 gave full FT 95 % and OSFT at URR 0.25
94 % format compliance, seed 0, measured 2026-11-30). Task B: the pilot of 2026-11-30
(``results/continual_pilot.json``: seed 0, the full run's 10 steps, rates 5e-5, 7e-5, 1e-4, 1.4e-4;
full FT at 5e-5 learned 0.781 nats/token) chose 1e-4 for ``osft_015`` (0.781) and ``osft_protect``
(0.784), 1.4e-4 for ``osft_inputs`` (0.764, the highest rate tried); ``osft_same`` and ``peft_osf``
were not piloted and keep 5e-5, at which they had learned 100 % and 98 % of full FT's B (two seeds,
the run committed before the pilot).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

#: Unfreeze rank ratio of the OSFT arms' task A (and of task B unless an arm says otherwise).
URR = 0.25
#: Fields of each step record kept in the results (the same for our trainer and PEFT's).
STEP_KEYS = ("step", "loss", "lr", "num_tokens", "step_time_s")


@dataclass(frozen=True)
class Spec:
    """How one phase trains: ``kind`` (``"trainer"``, ``"peft_osf"`` or ``"peft_lora"``), ``TrainConfig``
    fields (``config``; for ``peft_osf`` only ``osft_unfreeze_rank_ratio`` is read, for ``peft_lora``
    only ``lora_rank``, popped before the config is built) and ``learning_rate``."""

    kind: str
    config: dict
    learning_rate: float


#: Task-A runs, by name: full fine-tuning; OSFT at :data:`URR` (its export carries the update-based
#: protected subspaces, ``osft_subspaces.safetensors``); the same with input-activation right bases
#: (``--osft-protect-basis inputs``); PEFT's OSF at :data:`URR`. The settings of the committed run are
#: pinned (update bases, and task B's non-targets trained), not the chain recipe's defaults.
TASK_A_RUNS = {
    "full": Spec("trainer", {"osft": False}, 5e-5),
    "osft": Spec("trainer", {"osft": True, "osft_unfreeze_rank_ratio": URR, "osft_protect_basis": "update"}, 5e-5),
    "osft_inputs": Spec("trainer", {"osft": True, "osft_unfreeze_rank_ratio": URR, "osft_protect_basis": "inputs"},
                        5e-5),
    "peft_osf": Spec("peft_osf", {"osft_unfreeze_rank_ratio": URR}, 5e-5),
}


@dataclass(frozen=True)
class Arm:
    """One arm: ``name`` (JSON and plot id), ``label`` (tables), ``a_run`` (a :data:`TASK_A_RUNS`
    key) and ``b`` (task B's :class:`Spec`)."""

    name: str
    label: str
    a_run: str
    b: Spec


ARMS = [
    Arm("full_ft", "full FT -> full FT", "full", Spec("trainer", {"osft": False}, 5e-5)),
    Arm("osft_same", f"OSFT {URR} -> {URR}, unprotected", "osft",
        Spec("trainer", {"osft": True, "osft_unfreeze_rank_ratio": URR, "osft_protect_subspaces": False}, 5e-5)),
    Arm("osft_015", f"OSFT {URR} -> 0.15, unprotected (training_hub)", "osft",
        Spec("trainer", {"osft": True, "osft_unfreeze_rank_ratio": 0.15, "osft_protect_subspaces": False}, 1e-4)),
    Arm("osft_protect", f"OSFT {URR} -> {URR}, protected", "osft",
        Spec("trainer", {"osft": True, "osft_unfreeze_rank_ratio": URR, "freeze_non_target": False}, 1e-4)),
    Arm("osft_inputs", f"OSFT {URR} -> {URR}, protected, input bases", "osft_inputs",
        Spec("trainer", {"osft": True, "osft_unfreeze_rank_ratio": URR, "freeze_non_target": False}, 1.4e-4)),
    Arm("peft_osf", f"PEFT OSF {URR} -> {URR}", "peft_osf", Spec("peft_osf", {"osft_unfreeze_rank_ratio": URR}, 5e-5)),
]


@dataclass(frozen=True)
class Phase:
    """One task's training settings, the same for every arm.

    Attributes:
        task: ``"A"`` or ``"B"`` (a task name in the sequence benchmark). data_path: chat jsonl to
            train on, or a list of ``--data-path`` values (``PATH:WEIGHT`` for a mixture). steps: optimizer steps.
        batch_size: samples per step. max_seq_len: tokens per sample (longer ones truncated).
        max_tokens: tokens per packed micro-batch. lr_scheduler / warmup_steps: as ``osft-train``.
        seed: sampler and init seed.
    """

    task: str
    data_path: Path | list[str]
    steps: int
    batch_size: int
    max_seq_len: int
    max_tokens: int
    lr_scheduler: str
    warmup_steps: int
    seed: int


def _train_config(spec: Spec, phase: Phase, model_dir: Path, run_dir: Path, cache_dir: Path, learning_rate: float):
    from osft.trainer.config import TrainConfig, check_config

    data = phase.data_path if isinstance(phase.data_path, list) else [str(phase.data_path)]
    config = {k: v for k, v in spec.config.items() if k != "lora_rank"}
    cfg = TrainConfig(
        model_name_or_path=str(model_dir), data_path=data, output_dir=str(run_dir),
        max_seq_len=phase.max_seq_len, overlong="truncate", batch_size=phase.batch_size,
        max_tokens_per_gpu=phase.max_tokens, learning_rate=learning_rate, lr_scheduler=phase.lr_scheduler,
        warmup_steps=phase.warmup_steps, max_steps=phase.steps, seed=phase.seed,
        device="cpu", dtype="float32", save_dtype="float32", data_cache_dir=str(cache_dir),
        **config,
    )  # fmt: skip
    check_config(cfg)
    return cfg


def _trainer_phase(cfg, job: str) -> dict:
    from rich.console import Console

    from osft.trainer.run.loop import Trainer
    from osft.trainer.contract import read_records
    from osft.trainer.rundir import RunDir

    start = time.perf_counter()
    trainer = Trainer(cfg, console=Console(stderr=True, quiet=True), job_id=f"continual-{job}")
    trainer.prepare()
    setup_s = time.perf_counter() - start
    result = trainer.run()
    del trainer
    records = [r for f in sorted(RunDir(cfg.output_dir).metrics.glob("*.jsonl"))
               for r in read_records(f)[0] if r["event"] == "step"]
    return {"model_dir": Path(result.export_dir), "setup_s": setup_s, "train_s": time.perf_counter() - start - setup_s,
            "ortho_violations": result.violations_total, "steps": [{k: r[k] for k in STEP_KEYS} for r in records]}


def _peft_phase(cfg, out_dir: Path, lora_rank: int | None = None) -> dict:
    from peft_baselines import TARGET_NAMES, PeftTrainer, check_osf_split, osf_config

    want = {}

    def make_config(model):
        if lora_rank is not None:
            from peft import LoraConfig

            return LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=list(TARGET_NAMES))
        config, split = osf_config(model, cfg.osft_unfreeze_rank_ratio)
        want.update(split)
        return config

    start = time.perf_counter()
    trainer = PeftTrainer(cfg, make_config)
    if lora_rank is None:
        check_osf_split(trainer.model, want)
    setup_s = time.perf_counter() - start
    records = trainer.train()
    model_dir = trainer.save_merged(out_dir / "merged")
    del trainer
    return {"model_dir": model_dir, "setup_s": setup_s, "train_s": time.perf_counter() - start - setup_s,
            "ortho_violations": None, "steps": [{k: r[k] for k in STEP_KEYS} for r in records]}


def train_phase(spec: Spec, phase: Phase, model_dir: Path, out_dir: Path, cache_dir: Path,
                learning_rate: float | None = None) -> dict:
    """Train ``spec`` on ``phase`` starting from the dense model in ``model_dir``.

    Args:
        learning_rate: overrides ``spec.learning_rate`` (the pilot's candidates).

    Returns:
        ``model_dir`` (the dense float32 result, under ``out_dir``; for our trainer its HF export,
        which carries what the trainer exports with it), ``setup_s`` (s: load, tokenize,
        decompose), ``train_s`` (s: the steps and the export), ``ortho_violations`` (ours only) and
        ``steps`` (loss, lr, tokens, s per step).

    Raises:
        ValueError: an invalid setting (from the trainer's own config check).
    """
    lr = spec.learning_rate if learning_rate is None else learning_rate
    cfg = _train_config(spec, phase, model_dir, out_dir / "run", cache_dir, lr)
    if spec.kind == "trainer":
        result = _trainer_phase(cfg, out_dir.name)
    else:
        result = _peft_phase(cfg, out_dir, spec.config["lora_rank"] if spec.kind == "peft_lora" else None)
    gc.collect()
    return dict(result, learning_rate=lr)
