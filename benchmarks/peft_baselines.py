"""A Hugging Face PEFT baseline trained exactly like our trainer: PEFT's OSF.

:class:`PeftTrainer` wraps a model with a ``peft`` config and trains it with the trainer's own
pieces: tokenization (``tokenize_chat_file``), the global-batch sampler, LPT packing, the packed
collator, the token-mean loss, gradient clipping, AdamW and the LR schedule from ``TrainConfig``.
So the only difference from ``osft-train`` on the same config is the method.

Used by ``bench_step.py`` (step cost) and ``continual.py`` (retention benchmark).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

#: The trainer's default OSFT targets for Llama-style models (trainer/osft/targets.py).
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _targets(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_NAMES}


def osf_config(model: torch.nn.Module, urr: float):
    """A ``peft.OSFConfig`` that freezes exactly our rank split at unfreeze rank ratio ``urr``.

    PEFT's ``effective_rank`` is the *preserved* (frozen) rank: a float is a fraction of
    min(out, in), resolved per module as ``int(min_dim * value)``. Ours freezes
    ``k_high = floor(rank * (1 - URR))`` (``split_rank``); modules where the two roundings differ get
    an exact integer through ``rank_pattern``.

    Returns:
        ``(config, want)``: the config and the k_high we expect per target module name.
    """
    from peft import OSFConfig

    from osft.trainer.osft.plan import split_rank

    fraction = 1.0 - urr
    targets = _targets(model)
    want = {name: split_rank(min(mod.weight.shape), urr)[0] for name, mod in targets.items()}
    overrides = {f"^{name.replace('.', '[.]')}$": k for name, k in want.items()
                 if int(min(targets[name].weight.shape) * fraction) != k}
    config = OSFConfig(effective_rank=fraction, target_modules=list(TARGET_NAMES), rank_pattern=overrides or None)
    return config, want


def check_osf_split(peft_model, want: dict[str, int]) -> int:
    """Check that PEFT froze ``want[name]`` singular directions in every target; returns the module count.

    Raises:
        RuntimeError: a module's preserved rank differs from ours (examples named).
    """
    from peft.tuners.osf.layer import OSFLayer

    layers = {name.removeprefix("base_model.model."): mod for name, mod in peft_model.named_modules()
              if isinstance(mod, OSFLayer)}
    got = {name: layers[name].effective_rank["default"] for name in layers}
    if got != want:
        raise RuntimeError(f"PEFT rank split differs from ours: {len(got)} vs {len(want)} modules, "
                           f"e.g. {sorted(set(got.items()) ^ set(want.items()))[:4]}")
    return len(layers)


class PeftTrainer:
    """A PEFT-wrapped model trained with the trainer's data pipeline, loss and optimizer settings.

    Args:
        cfg: the run's ``TrainConfig`` (``osft`` is ignored; model, data, batching, AdamW, schedule,
            steps and seed are used as ``osft-train`` uses them; CPU/float32 only).
        make_config: builds the PEFT config from the loaded (unwrapped) model.
        trainable: optional predicate on parameter names of the wrapped model that replaces PEFT's
            choice of trainable parameters.

    Attributes:
        wrap_s: seconds spent in ``get_peft_model`` (PEFT's OSF runs its SVDs there).
        total_steps: optimizer steps of :meth:`train` (``max_steps``, else epochs x steps per epoch).
    """

    def __init__(self, cfg, make_config: Callable[[torch.nn.Module], object],
                 trainable: Callable[[str], bool] | None = None) -> None:
        from peft import get_peft_model
        from transformers import get_scheduler

        from osft.trainer.data.sampler import GlobalBatchSampler
        from osft.trainer.data.mixture import tokenize_for_run
        from osft.trainer.run.components import seed_everything
        from osft.trainer.run.start import shifted_loss_tokens
        from osft.trainer.model.loading import load_model, load_tokenizer
        from osft.trainer.model.packed_attention import use_packed_attention

        self.cfg = cfg
        seed_everything(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model_name_or_path)
        self.data, _ = tokenize_for_run(cfg, self.tokenizer, print)  # as our trainer tokenizes (every --data-path)
        self.lengths = self.data.lengths
        self.loss_tokens = shifted_loss_tokens(self.data.dataset["labels"])
        model = load_model(cfg.model_name_or_path, torch.float32, "cpu")
        model.train()
        self.packed_attention = use_packed_attention(model)  # the trainer's attention: speed compares OSF itself
        peft_config = make_config(model)
        start = time.perf_counter()
        self.model = get_peft_model(model, peft_config)
        self.wrap_s = time.perf_counter() - start
        if trainable is not None:
            for name, p in self.model.named_parameters():
                p.requires_grad_(trainable(name))
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.sampler = GlobalBatchSampler(len(self.data), cfg.batch_size, cfg.seed)
        self.total_steps = cfg.max_steps or cfg.num_epochs * self.sampler.steps_per_epoch
        self.scheduler = get_scheduler(cfg.lr_scheduler, self.optimizer, num_warmup_steps=cfg.warmup_steps,
                                       num_training_steps=self.total_steps)

    def step(self, step: int, indices: list[int]) -> dict:
        """One optimizer step on the samples ``indices``: forward/backward every packed micro-batch
        (PEFT's OSF projects gradients in backward hooks), clip, AdamW step, schedule step.

        Returns:
            ``{"loss", "num_tokens", "lr", "step_time_s"}`` (loss: summed CE / loss tokens of the batch).
        """
        from osft.trainer.data.collate import collate_packed
        from osft.trainer.data.packing import plan_micro_batches
        from osft.trainer.data.tokenize import IGNORE_INDEX
        from osft.trainer.model.packed_attention import BOUNDS_KWARG

        start = time.perf_counter()
        idx = np.asarray(indices, dtype=np.int64)
        total_loss_tokens = int(self.loss_tokens[idx].sum())
        plan = plan_micro_batches(self.lengths[idx], self.cfg.max_tokens_per_gpu, 1)[0]
        loss_sum, num_tokens = 0.0, 0
        lr = self.scheduler.get_last_lr()[0]
        for micro in plan:
            batch = collate_packed([self.data[int(idx[i])] for i in micro])
            bounds = {BOUNDS_KWARG: batch["sample_bounds"]} if self.packed_attention else {}
            logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                use_cache=False, **bounds).logits
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), batch["labels"].view(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
            (loss / total_loss_tokens).backward()
            loss_sum += float(loss.detach())
            num_tokens += int(batch["num_tokens"])
        torch.nn.utils.clip_grad_norm_([p for p in self.params if p.grad is not None], self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum / total_loss_tokens, "num_tokens": num_tokens, "lr": lr,
                "step_time_s": time.perf_counter() - start}

    def train(self) -> list[dict]:
        """Run :attr:`total_steps` steps over the sampler's batches (as ``Trainer.run``); returns
        the step records."""
        records = []
        for step in range(self.total_steps):
            epoch, index = divmod(step, self.sampler.steps_per_epoch)
            records.append(dict(self.step(step + 1, self.sampler.batch(epoch, index)), step=step + 1))
        return records

    def save_merged(self, out_dir: Path) -> Path:
        """Merge the adapters into the base weights and save a dense float32 HF model directory."""
        from osft.trainer.checkpoint.hf_export import save_hf_model

        merged = self.model.merge_and_unload()
        save_hf_model(merged.config, merged.state_dict(), self.tokenizer, Path(out_dir), torch.float32,
                      generation_config=merged.generation_config, overwrite=True)
        return Path(out_dir)
