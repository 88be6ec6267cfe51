"""Per-step cost of OSFT against full fine-tuning, Hugging Face PEFT's OSF and a plain transformers
step, on CPU.

Five methods train the same model on the same fixed batch of samples (the same tokens):

- ``osft``: our trainer (``Trainer.prepare()`` then ``Trainer.train_step``), OSFT on.
- ``full_ft``: the same trainer with ``osft=False`` (``--no-osft``): plain full fine-tuning.
- ``peft_osf``: ``peft.OSFConfig`` + ``get_peft_model`` on the same target modules with the same
  rank split, driven by a step written here with our packing, collate and loss.
- ``hf_unpacked`` / ``hf_packed``: a plain transformers step written as a user would (``labels=``
  loss, stock AdamW), on the samples as padded rows or packed into one row (``PlainHFRunner``):
  the reference our full fine-tuning is held to.

Every method runs in its own worker subprocess (so its peak RSS is its own). The workers start one
after the other (each: load, decompose, :data:`WARMUP_STEPS` warm-up steps), then the timed steps run interleaved in
rounds, A B C D E A B C D E ..., so that noise on a shared machine hits all of them alike. Ratios are taken
against ``full_ft`` from medians of the same run. Each method's achieved model FLOP/s and MFU
(``osft.trainer.observe.flops``: the same PaLM formula for every method) are taken against the fp32 GEMM
peak measured in this process just before and after the rounds, with the workers' thread count
(the higher of the two: on a loaded machine the least disturbed measurement).

With ``--baseline CHECKOUT`` a sixth worker, ``osft_baseline``, runs ``osft`` with another
checkout's code (its own interpreter, ``--baseline-python``), interleaved with the others: the
effect of a change on the OSFT step, side by side in one run (``osft_vs_baseline``: the ratio of
medians and the median of the per-round ratios).

Usage::

    python benchmarks/bench_step.py                       # tiny + smollm2, results/bench_step.json
    python benchmarks/bench_step.py --models smollm2 --methods osft,full_ft,peft_osf --baseline /tmp/base
    python benchmarks/bench_step.py --models smollm2 --rounds 4 --steps 2
    python benchmarks/bench_step.py --quick --out /tmp/b.json   # pipeline check, tiny only

Internally ``--worker METHOD --spec FILE`` runs one worker; it talks JSON lines on its stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from machine import git_revision, machine_info

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "bench_step.json"
#: Untimed steps before the rounds: an OSFT step 1 runs the full orthogonality check and the first
#: step after it forms the deviation bound's float64 Gram matrices of the bases (about 1.4 s on
#: SmolLM2), both once per run; with one warm-up step the second landed in the first timed round.
WARMUP_STEPS = 2
METHODS = ("osft", "full_ft", "peft_osf", "hf_unpacked", "hf_packed")
METHOD_LABELS = {"osft": "OSFT (ours)", "full_ft": "full FT (ours, --no-osft)", "peft_osf": "PEFT OSF",
                 "hf_unpacked": "plain transformers, padded", "hf_packed": "plain transformers, packed",
                 "osft_baseline": "OSFT, baseline checkout"}
#: The extra method of ``--baseline``: OSFT as another checkout's code runs it, beside ours.
BASELINE_METHOD = "osft_baseline"
MODELS = ("tiny", "smollm2")

#: Goals reported (never asserted; benchmarks/README.md): OSFT step time at most this multiple of our full fine-tuning,
GOAL_STEP_RATIO = 1.05
#: ... and at most this multiple of PEFT's OSF;
GOAL_VS_PEFT = 0.85
#: our full fine-tuning at most this multiple of the faster plain transformers step on the same tokens,
GOAL_FULL_VS_PLAIN = 1.05
#: and at least this share of the fp32 GEMM peak measured in the same run (SmolLM2).
GOAL_FULL_MFU = 0.60
#: Goal for the decomposition of every SmolLM2-135M target, seconds.
GOAL_SMOLLM2_SVD_S = 10.0

#: Tiny model: a random Llama built from this config (and the tiny test tokenizer's vocabulary).
TINY_CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024)


# ------------------------------------------------------------------------------------------ worker

def pick_batch(lengths, batch_size: int) -> list[int]:
    """Indices of the ``batch_size`` longest samples (ties: lower index first), sorted.

    Every method tokenizes the same file the same way, so each picks the same samples; the longest
    ones make the batch close to ``batch_size × max_seq_len`` tokens.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    return sorted(order[:batch_size])


class TrainerRunner:
    """Our trainer, OSFT on or off: ``prepare()`` once, then the real ``train_step``."""

    def __init__(self, spec: dict, osft: bool) -> None:
        from rich.console import Console

        from osft.trainer.config import TrainConfig
        from osft.trainer.run.loop import Trainer

        cfg = TrainConfig(**_train_config_kwargs(spec), osft=osft)
        self.trainer = Trainer(cfg, console=Console(stderr=True), job_id=f"bench-{spec['method']}")
        self.trainer.prepare()
        self.lengths = self.trainer.lengths
        self.svd_s = self.trainer.osft.svd_seconds if self.trainer.osft else None
        self.model = self.trainer.model
        self.extra = {}
        if self.trainer.osft:
            self.extra["osft_modules"] = len(self.trainer.osft.modules)
            forms = [m.forward_form for m in self.trainer.osft.osft_modules]
            self.extra["forward_forms"] = {f: forms.count(f) for f in sorted(set(forms))}

    def step(self, step: int, indices: list[int]) -> dict:
        """One optimizer step (s measured by the caller); returns loss and token count."""
        record = self.trainer.train_step(step, indices)
        return {"loss": record["loss"], "num_tokens": record["num_tokens"]}


class PeftRunner:
    """PEFT's OSF on the same model, data, batch, loss and AdamW settings as our trainer."""

    def __init__(self, spec: dict) -> None:
        from peft_baselines import PeftTrainer, check_osf_split, osf_config

        from osft.trainer.config import TrainConfig

        cfg = TrainConfig(**_train_config_kwargs(spec), osft=False)
        split = {}

        def make_config(model):
            config, split["want"] = osf_config(model, cfg.osft_unfreeze_rank_ratio)
            split["overrides"] = len(config.rank_pattern or {})
            return config

        # "matched": train what our trainer trains, the OSF factors and every non-target parameter
        # (embeddings, norms, head); only the targets' dense base weights stay frozen.
        matched = spec["peft_trainable"] == "matched"
        self.trainer = PeftTrainer(cfg, make_config,
                                   (lambda name: "osf_svd_params" in name or ".base_layer." not in name) if matched
                                   else None)
        self.model, self.lengths, self.svd_s = self.trainer.model, self.trainer.lengths, self.trainer.wrap_s
        self.extra = {"peft_effective_rank": 1.0 - cfg.osft_unfreeze_rank_ratio,
                      "peft_rank_pattern_overrides": split["overrides"],
                      "osft_modules": check_osf_split(self.model, split["want"]),
                      "peft_trainable": spec["peft_trainable"]}

    def step(self, step: int, indices: list[int]) -> dict:
        """One optimizer step of :class:`peft_baselines.PeftTrainer`; returns loss and token count."""
        record = self.trainer.step(step, indices)
        return {"loss": record["loss"], "num_tokens": record["num_tokens"]}


class PlainHFRunner:
    """A plain transformers training step, the way a user writes one by hand: the model from
    ``AutoModelForCausalLM.from_pretrained``, ``model(input_ids, ..., labels=labels).loss`` (transformers'
    own shift and mean cross-entropy over every position's fp32 logits), ``clip_grad_norm_``, a stock
    ``torch.optim.AdamW`` with the trainer's default settings, no scheduler. The tokens are the
    trainer's own (``tokenize_for_run``), so the first loss equals our full fine-tuning's.

    ``packed=False``: the batch's samples as rows right-padded to the longest, with an attention
    mask (a B x L step). ``packed=True``: one row of every sample back to back with ``position_ids``
    restarting at 0, from which transformers builds the block-diagonal causal mask (a 1 x T step).
    """

    def __init__(self, spec: dict, packed: bool) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from osft.trainer.config import TrainConfig
        from osft.trainer.data.mixture import tokenize_for_run
        from osft.trainer.run.components import seed_everything
        from osft.trainer.model.loading import load_tokenizer

        cfg = TrainConfig(**_train_config_kwargs(spec), osft=False)
        seed_everything(cfg.seed)
        tokenizer = load_tokenizer(cfg.model_name_or_path)
        self.data, _ = tokenize_for_run(cfg, tokenizer, print)
        self.lengths = self.data.lengths
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.packed = packed
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, dtype=torch.float32).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.max_grad_norm = cfg.max_grad_norm
        self.svd_s, self.extra = None, {"layout": "packed 1 x T" if packed else "padded B x L"}

    def _batch(self, indices: list[int]) -> dict:
        """The step's model inputs: ``input_ids`` and ``labels`` (unshifted, -100 where not trained)
        of shape [1, T] with ``position_ids`` (packed), or [B, L] with ``attention_mask`` (padded)."""
        import torch

        from osft.trainer.data.tokenize import IGNORE_INDEX

        samples = [self.data[int(i)] for i in indices]
        ids = [torch.as_tensor(s["input_ids"], dtype=torch.long) for s in samples]
        labels = [torch.as_tensor(s["labels"], dtype=torch.long).clone() for s in samples]
        if self.packed:
            for lab in labels:  # transformers shifts within the row: no sample predicts the next one's first token
                lab[0] = IGNORE_INDEX
            return dict(input_ids=torch.cat(ids)[None], labels=torch.cat(labels)[None],
                        position_ids=torch.cat([torch.arange(len(t)) for t in ids])[None])
        width = max(len(t) for t in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        label_rows = torch.full((len(ids), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, (t, lab) in enumerate(zip(ids, labels)):
            input_ids[row, :len(t)], label_rows[row, :len(t)], mask[row, :len(t)] = t, lab, 1
        return dict(input_ids=input_ids, labels=label_rows, attention_mask=mask)

    def step(self, step: int, indices: list[int]) -> dict:
        """One optimizer step on the samples ``indices``; returns loss and token count (real tokens,
        padding not counted)."""
        import torch

        batch = self._batch(indices)
        loss = self.model(**batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(loss.detach()), "num_tokens": int(sum(int(self.lengths[i]) for i in indices))}


def make_runner(method: str, spec: dict) -> TrainerRunner | PeftRunner | PlainHFRunner:
    """The runner of ``method`` (one of :data:`METHODS`), prepared on ``spec`` (model, data, batching)."""
    if method == "peft_osf":
        return PeftRunner(spec)
    if method.startswith("hf_"):
        return PlainHFRunner(spec, packed=method == "hf_packed")
    return TrainerRunner(spec, osft=method == "osft")


def _train_config_kwargs(spec: dict) -> dict:
    """TrainConfig fields shared by every method (all optimiser settings stay at their defaults)."""
    return dict(model_name_or_path=spec["model_dir"], data_path=spec["data_path"], output_dir=spec["run_dir"],
                max_seq_len=spec["max_seq_len"], batch_size=spec["batch_size"],
                max_tokens_per_gpu=spec["max_tokens_per_gpu"], osft_unfreeze_rank_ratio=spec["urr"],
                device="cpu", dtype="float32", seed=spec["seed"])


def seconds_since_process_start() -> float:
    """Wall seconds since this process started (Linux: from /proc, 10 ms resolution; elsewhere
    psutil's create time, which may be off by up to a second)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22, starttime, in clock ticks since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        return time.time() - psutil.Process().create_time()


def worker_main(method: str, spec_path: str) -> int:
    """Run one method: prepare, :data:`WARMUP_STEPS` warm-up steps, then timed steps on request;
    reports on stdout.

    Protocol (one JSON object per line): after the warm-up it writes ``ready`` (``first_step_s``:
    s from process start to the end of the first warm-up step; ``svd_s``; ``prepare_s``; the batch).
    Then it reads commands on stdin: ``{"cmd": "steps", "n": N}`` answers the N step times (s);
    ``{"cmd": "quit"}`` answers ``peak_rss_bytes`` (``ru_maxrss``) and exits.
    """
    import resource

    import psutil

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by libraries goes to stderr, never into the protocol

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    spec = json.loads(Path(spec_path).read_text())
    spec["method"] = method
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))

    t0 = time.perf_counter()
    runner = make_runner(method, spec)
    prepare_s = time.perf_counter() - t0
    indices = pick_batch(runner.lengths, spec["batch_size"])
    t1 = time.perf_counter()
    first = runner.step(1, indices)
    warmup_s = time.perf_counter() - t1
    first_step_s = seconds_since_process_start()
    for step in range(2, WARMUP_STEPS + 1):
        runner.step(step, indices)
    params = list(runner.model.parameters())
    send(dict(event="ready", first_step_s=first_step_s, prepare_s=prepare_s, warmup_step_s=warmup_s,
              svd_s=runner.svd_s, indices=indices, num_tokens=first["num_tokens"], first_loss=first["loss"],
              lengths=[int(runner.lengths[i]) for i in indices],
              trainable_params=sum(p.numel() for p in params if p.requires_grad),
              total_params=sum(p.numel() for p in params), torch_threads=torch.get_num_threads(),
              cpu_s=sum(os.times()[:2]),
              **runner.extra))
    step = WARMUP_STEPS
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "steps":
            times, losses = [], []
            for _ in range(int(cmd["n"])):
                step += 1
                t = time.perf_counter()
                out = runner.step(step, indices)
                times.append(time.perf_counter() - t)
                losses.append(out["loss"])
            send(dict(event="steps", times=times, losses=losses))
        elif cmd["cmd"] == "quit":
            send(dict(event="bye", peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      rss_bytes=psutil.Process().memory_info().rss))
            return 0
    return 1


# ------------------------------------------------------------------------------------------ parent

@dataclass
class _Worker:
    """A running worker process and what it reported."""

    method: str
    proc: subprocess.Popen
    log_path: Path
    ready: dict = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    foreign: list[float] = field(default_factory=list)
    steal: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    bye: dict = field(default_factory=dict)

    def request(self, cmd: dict | None) -> dict:
        """Send ``cmd`` (if any) and wait for the worker's next line."""
        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""
            raise RuntimeError(f"worker {self.method} exited with code {self.proc.returncode}; "
                               f"log {self.log_path}:\n{tail}")
        return json.loads(line)


def _launch_worker(method: str, spec_path: Path, log_dir: Path, verbose: bool,
                   baseline: tuple[Path, str] | None = None) -> _Worker:
    """Start one worker process (it then loads, decomposes and runs its warm-up step). The
    :data:`BASELINE_METHOD` runs ``osft`` with the ``baseline`` = (checkout, interpreter)'s code."""
    log_path = log_dir / f"{method}.log"
    stderr = None if verbose else open(log_path, "w")
    tree, python, worker = REPO, sys.executable, method
    if method == BASELINE_METHOD:
        (tree, python), worker = baseline, "osft"
    proc = subprocess.Popen(
        [python, str(tree / "benchmarks" / "bench_step.py"), "--worker", worker, "--spec", str(spec_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=str(tree),
    )
    if stderr is not None:
        stderr.close()
    return _Worker(method, proc, log_path)


def _synthetic_chats(n: int, seed: int) -> list[dict]:
    """``n`` random conversations of plain words, 2 to 160 words each over 1 to 5 user/assistant
    turn pairs (for the tiny model: lengths spread from a few dozen to a few hundred tokens)."""
    words = ("the capital of france is paris hello world thanks sure here answer what why because seven "
             "ate nine explain gradient descent walks downhill loss surface tell me a joke about numbers "
             "assistant user system one sentence").split()
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        turns = 2 * rng.randint(1, 5)
        budget = rng.randint(turns, 160)
        cuts = sorted(rng.sample(range(1, budget), turns - 1)) if turns > 1 else []
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, budget])]
        msgs = [{"role": "user" if t % 2 == 0 else "assistant",
                 "content": " ".join(rng.choice(words) for _ in range(size))} for t, size in enumerate(sizes)]
        rows.append({"messages": msgs})
    return rows


def prepare_tiny(root: Path, seed: int) -> tuple[Path, Path, dict]:
    """Save the tiny random Llama (+ tiny tokenizer) and a synthetic chat jsonl under ``root``."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import save_tiny_model  # the project's own offline test helpers

    model_dir = save_tiny_model(root / "tiny-llama", seed=seed, **TINY_CONFIG)
    data = root / "tiny-chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _synthetic_chats(128, seed)))
    return model_dir, data, dict(TINY_CONFIG, vocab_size=json.loads((model_dir / "config.json").read_text())["vocab_size"],
                                     weights="random")


def prepare_smollm2(root: Path, demo_dir: str | None, data_lines: int) -> tuple[Path, Path, dict]:
    """The demo SmolLM2-135M-Instruct dir and the first ``data_lines`` chit-chat conversations."""
    from assets import demo_assets

    assets = demo_assets(demo_dir)
    data = root / "chitchat-subset.jsonl"
    with open(assets.train_path, encoding="utf-8") as src:
        lines = [line for _, line in zip(range(data_lines), src)]
    data.write_text("".join(lines))
    cfg = json.loads((assets.model_dir / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings")
    return assets.model_dir, data, {k: cfg.get(k) for k in keys} | {"weights": "SmolLM2-135M-Instruct"}


def gemm_peak(threads: int | None) -> float:
    """The fp32 GEMM peak of this process (FLOP/s, :func:`osft.trainer.observe.matmul_peak.measure_matmul_peak`),
    with ``threads`` torch threads (the workers' setting; None: torch's default)."""
    import torch

    from osft.trainer.observe.matmul_peak import measure_matmul_peak

    if threads:
        torch.set_num_threads(int(threads))
    return measure_matmul_peak(torch.device("cpu"), torch.float32, repeats=5)


def _cpu_snapshot(pid: int) -> tuple[float, float, float, float]:
    """(wall s, busy CPU s of the whole machine, steal CPU s, CPU s of process ``pid``)."""
    import psutil

    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    p = psutil.Process(pid).cpu_times()
    return time.perf_counter(), busy, getattr(t, "steal", 0.0), p.user + p.system


def _foreign_share(before: tuple, after: tuple) -> tuple[float, float]:
    """Share of the machine's CPU capacity (0..1) used by *other* processes between two snapshots
    of one worker, and the share stolen by the hypervisor."""
    wall = max(after[0] - before[0], 1e-9) * (os.cpu_count() or 1)
    others = (after[1] - before[1]) - (after[3] - before[3])
    return max(0.0, others) / wall, max(0.0, after[2] - before[2]) / wall


def _wait_for_quiet(budget_s: float, threshold: float) -> float:
    """Wait (at most ``budget_s`` seconds) until other processes use at most ``threshold`` of the
    CPUs, sampled over 0.3 s while every worker is idle. Returns the seconds waited."""
    import psutil

    waited = 0.0
    while waited < budget_s:
        if psutil.cpu_percent(interval=0.3) / 100.0 <= threshold:
            break
        waited += 0.3
    return waited


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def bench_model(name: str, args: argparse.Namespace, tmp: Path, console) -> dict:
    """Run every method on one model; return its JSON section."""
    root = tmp / name
    root.mkdir()
    if name == "tiny":
        model_dir, data_path, model_info = prepare_tiny(root, args.seed)
    else:
        model_dir, data_path, model_info = prepare_smollm2(root, args.demo_dir, args.data_lines)
    workers: dict[str, _Worker] = {}
    idle_waited = 0.0
    try:
        for method in args.methods:
            spec = dict(model_dir=str(model_dir), data_path=str(data_path), run_dir=str(root / f"run-{method}"),
                        max_seq_len=args.max_seq_len, batch_size=args.batch_size,
                        max_tokens_per_gpu=args.max_tokens_per_gpu, urr=args.urr, seed=args.seed,
                        peft_trainable=args.peft_trainable, threads=args.threads)
            spec_path = root / f"spec-{method}.json"
            spec_path.write_text(json.dumps(spec))
            console.print(f"\\[{name}] starting {METHOD_LABELS[method]} ...")
            if not args.parallel_start:
                idle_waited += _wait_for_quiet(max(0.0, args.idle_wait - idle_waited), args.clean_threshold)
            workers[method] = w = _launch_worker(method, spec_path, root, args.verbose,
                                                 (args.baseline, args.baseline_python) if args.baseline else None)
            if not args.parallel_start:  # one at a time, so start-up times are not inflated by each other
                before = _cpu_snapshot(w.proc.pid)
                w.ready = w.request(None)
                # the worker's own CPU time counts from its start: compare with the machine's busy time
                after = _cpu_snapshot(os.getpid())
                wall = max(after[0] - before[0], 1e-9) * (os.cpu_count() or 1)
                w.ready["startup_others_cpu_share"] = max(0.0, (after[1] - before[1]) - w.ready["cpu_s"]) / wall
        for method, w in workers.items():
            if not w.ready:
                w.ready = w.request(None)
            r = w.ready
            svd = f", SVD {r['svd_s']:.2f} s" if r["svd_s"] is not None else ""
            console.print(f"\\[{name}] {METHOD_LABELS[method]}: first step done {r['first_step_s']:.1f} s after "
                          f"process start{svd}; batch {len(r['indices'])} samples, {r['num_tokens']} tokens")
        batches = {(tuple(w.ready["indices"]), w.ready["num_tokens"]) for w in workers.values()}
        if len(batches) != 1:
            raise RuntimeError(f"[{name}] the methods picked different batches: {batches}")
        peaks = [gemm_peak(args.threads)]
        round_load = []
        for rnd in range(args.rounds):
            round_load.append(os.getloadavg()[0])
            for method in args.methods:
                w = workers[method]
                idle_waited += _wait_for_quiet(max(0.0, args.idle_wait - idle_waited), args.clean_threshold)
                before = _cpu_snapshot(w.proc.pid)
                out = w.request({"cmd": "steps", "n": args.steps})
                foreign, steal = _foreign_share(before, _cpu_snapshot(w.proc.pid))
                w.times += out["times"]
                w.foreign += [foreign] * len(out["times"])
                w.steal += [steal] * len(out["times"])
                w.losses += out["losses"]
                w.round_medians.append(_median(out["times"]))
            console.print(f"\\[{name}] round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{m} {workers[m].round_medians[-1]:.3f} s (others {workers[m].foreign[-1]:.0%} CPU)" for m in args.methods))
        peaks.append(gemm_peak(args.threads))
        for w in workers.values():
            w.bye = w.request({"cmd": "quit"})
            w.proc.wait(timeout=120)
    finally:
        for w in workers.values():
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()

    ready = workers["full_ft"].ready
    section = dict(model=model_info, batch=dict(num_samples=len(ready["indices"]), num_tokens=ready["num_tokens"],
                                                sample_lengths=ready["lengths"], indices=ready["indices"]),
                   load_avg_1min_at_round_start=round_load, methods={}, ratios_vs_full_ft={},
                   gemm_peak_flops_per_s=max(peaks), gemm_peak_samples_flops_per_s=peaks)
    from osft.trainer.observe.flops import flop_model, mfu
    from osft.trainer.model.loading import load_config

    flops = flop_model(load_config(model_dir))
    step_flops = flops.step_flops(ready["lengths"])
    section["model_flops_per_step"] = dict(flops.to_json(), flops=step_flops)
    for method, w in workers.items():
        r = w.ready
        med = _median(w.times)
        clean = [t for t, f in zip(w.times, w.foreign) if f <= args.clean_threshold]
        section["methods"][method] = dict(
            label=METHOD_LABELS[method], step_time_s=med, step_time_samples_s=w.times,
            step_time_min_s=min(w.times), step_time_clean_median_s=_median(clean) if clean else None,
            clean_steps=len(clean), others_cpu_share_per_step=w.foreign, steal_share_per_step=w.steal,
            tokens_per_s=r["num_tokens"] / med, flops_per_s=step_flops / med,
            mfu=mfu(step_flops, med, max(peaks)), peak_rss_bytes=w.bye["peak_rss_bytes"],
            rss_end_bytes=w.bye["rss_bytes"], first_step_s=r["first_step_s"], svd_s=r["svd_s"],
            prepare_s=r["prepare_s"], warmup_step_s=r["warmup_step_s"], trainable_params=r["trainable_params"],
            total_params=r["total_params"], torch_threads=r["torch_threads"], first_loss=r["first_loss"],
            last_loss=w.losses[-1] if w.losses else None,
            startup_others_cpu_share=r.get("startup_others_cpu_share"),
            **{k: r[k] for k in ("osft_modules", "forward_forms", "peft_effective_rank",
                                 "peft_rank_pattern_overrides", "peft_trainable", "layout") if k in r},
        )
    section["idle_wait_s"] = idle_waited
    base = section["methods"]["full_ft"]

    def ratio(m: dict, key: str) -> float | None:
        return None if m[key] is None or base[key] is None else m[key] / base[key]

    def paired_ratio(a: str, b: str) -> float:
        """Median over rounds of method a's round median / b's: robust to a machine whose speed drifts."""
        return _median([x / y for x, y in zip(workers[a].round_medians, workers[b].round_medians)])

    for method in args.methods:
        m = section["methods"][method]
        section["ratios_vs_full_ft"][method] = dict(
            step_time=ratio(m, "step_time_s"),
            step_time_clean=ratio(m, "step_time_clean_median_s"),
            step_time_min=ratio(m, "step_time_min_s"),
            step_time_paired_rounds_median=paired_ratio(method, "full_ft"),
            tokens_per_s=ratio(m, "tokens_per_s"),
            peak_rss=ratio(m, "peak_rss_bytes"),
            first_step=ratio(m, "first_step_s"),
        )
    ours, peft = section["methods"]["osft"], section["methods"]["peft_osf"]
    r_ours = section["ratios_vs_full_ft"]["osft"]
    if BASELINE_METHOD in workers:
        section["osft_vs_baseline"] = dict(
            step_time=ours["step_time_s"] / section["methods"][BASELINE_METHOD]["step_time_s"],
            step_time_paired_rounds_median=paired_ratio("osft", BASELINE_METHOD))

    def vs_peft(key: str) -> float | None:
        return None if ours[key] is None or peft[key] is None else ours[key] / peft[key]

    full = section["methods"]["full_ft"]
    plain_method = min((m for m in ("hf_unpacked", "hf_packed") if m in section["methods"]),
                       key=lambda m: section["methods"][m]["step_time_s"], default=None)
    plain = section["methods"][plain_method] if plain_method else None

    def vs_plain(key: str) -> float | None:
        return None if full[key] is None or plain[key] is None else full[key] / plain[key]

    def goal(value: float, target: float, value_paired: float, **extra) -> dict:
        """A ratio goal: met when both the ratio of medians and the median of per-round ratios are."""
        return dict(value=value, value_paired=value_paired, target=target,
                    met=value <= target and value_paired <= target, **extra)

    goals = {
        f"osft_step_time_le_{GOAL_STEP_RATIO:.2f}x_full_ft": goal(
            r_ours["step_time"], GOAL_STEP_RATIO, r_ours["step_time_paired_rounds_median"],
            value_clean=r_ours["step_time_clean"], value_min=r_ours["step_time_min"]),
        f"osft_step_time_le_{GOAL_VS_PEFT:.2f}x_peft_osf": goal(
            vs_peft("step_time_s"), GOAL_VS_PEFT, paired_ratio("osft", "peft_osf"),
            value_clean=vs_peft("step_time_clean_median_s"), value_min=vs_peft("step_time_min_s")),
    }
    if plain is not None:
        goals[f"full_ft_step_time_le_{GOAL_FULL_VS_PLAIN:.2f}x_plain_transformers"] = goal(
            vs_plain("step_time_s"), GOAL_FULL_VS_PLAIN, paired_ratio("full_ft", plain_method),
            value_clean=vs_plain("step_time_clean_median_s"), value_min=vs_plain("step_time_min_s"),
            against=plain["label"])
    if name == "smollm2":
        goals[f"full_ft_mfu_ge_{GOAL_FULL_MFU:.2f}"] = dict(value=full["mfu"], target=GOAL_FULL_MFU,
                                                            met=full["mfu"] is not None and full["mfu"] >= GOAL_FULL_MFU)
    if name == "smollm2":
        goals[f"osft_svd_le_{GOAL_SMOLLM2_SVD_S:g}s"] = dict(
            value=ours["svd_s"], target=GOAL_SMOLLM2_SVD_S, met=ours["svd_s"] <= GOAL_SMOLLM2_SVD_S,
            startup_others_cpu_share=ours["startup_others_cpu_share"])
    section["goals"] = goals
    return section


def print_report(result: dict, console) -> None:
    """A rich table per model and the goal verdicts (on medians of all steps; the clean-step and
    minimum ratios are shown next to them because the machine may be shared)."""
    from rich.table import Table

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for name, sec in result["models"].items():
        b = sec["batch"]
        n = len(sec["methods"]["full_ft"]["step_time_samples_s"])
        table = Table(title=f"{name}: {b['num_samples']} samples, {b['num_tokens']} tokens/step, "
                            f"URR {result['settings']['urr']}, {n} timed steps/method; GEMM peak "
                            f"{sec['gemm_peak_flops_per_s'] / 1e9:.1f} GFLOP/s")
        for col in ("method", "step s median", "x full", "clean s (n)", "x full clean", "min s", "x full min",
                    "tokens/s", "GFLOP/s", "MFU", "peak RSS MiB", "x full RSS", "first step s", "SVD s", "trainable"):
            table.add_column(col, justify="left" if col == "method" else "right")
        for method, m in sec["methods"].items():
            r = sec["ratios_vs_full_ft"][method]
            table.add_row(
                m["label"], f"{m['step_time_s']:.3f}", f"{r['step_time']:.3f}",
                f"{num(m['step_time_clean_median_s'], '.3f')} ({m['clean_steps']})", num(r["step_time_clean"], ".3f"),
                f"{m['step_time_min_s']:.3f}", f"{r['step_time_min']:.3f}", f"{m['tokens_per_s']:.0f}",
                f"{m['flops_per_s'] / 1e9:.1f}", num(m["mfu"], ".1%"),
                f"{m['peak_rss_bytes'] / 2**20:.0f}", f"{r['peak_rss']:.2f}", f"{m['first_step_s']:.1f}",
                num(m["svd_s"], ".2f"), f"{m['trainable_params'] / 1e6:.1f} M")
        console.print(table)
        for goal, g in sec["goals"].items():
            verdict = "[green]met[/green]" if g["met"] else "[red]NOT met[/red]"
            extra = ""
            if "value_clean" in g:
                extra = (f" (paired rounds: {g['value_paired']:.3f}, clean steps: {num(g['value_clean'], '.3f')}, "
                         f"minima: {num(g['value_min'], '.3f')})")
            share = g.get("startup_others_cpu_share")
            if share is not None and share > result["settings"]["clean_threshold"]:
                extra += f" [yellow](other processes used {share:.0%} of the CPUs during start-up)[/yellow]"
            console.print(f"  goal {goal}: {g['value']:.3f} (target {g['target']:g}) {verdict}{extra}")
        if "osft_vs_baseline" in sec:
            v, rev = sec["osft_vs_baseline"], (result["settings"]["baseline"] or {}).get("rev")
            console.print(f"  OSFT step / the baseline checkout's ({rev}): {v['step_time']:.3f} "
                          f"(median of paired rounds {v['step_time_paired_rounds_median']:.3f})")


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2", help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--steps", type=int, default=1, help="timed steps per method per round")
    p.add_argument("--rounds", type=int, default=10, help="rounds of interleaving (each method once per round)")
    p.add_argument("--urr", type=float, default=0.25, help="unfreeze rank ratio, in (0, 1)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per step")
    p.add_argument("--max-seq-len", type=int, default=256, help="tokens per sample (longer ones are dropped)")
    p.add_argument("--max-tokens-per-gpu", type=int, default=1024, help="token budget of one packed micro-batch")
    p.add_argument("--data-lines", type=int, default=400, help="chit-chat conversations tokenized (smollm2)")
    p.add_argument("--peft-trainable", choices=["matched", "adapter-only"], default="matched",
                   help="matched: PEFT also trains every non-target parameter, as our trainer does; "
                        "adapter-only: PEFT's default (only the OSF factors train)")
    p.add_argument("--demo-dir", default=None, help="demo assets dir (default: $OSFT_DEMO_DIR, the pytest cache, "
                                                    "else fetch_demo's default)")
    p.add_argument("--idle-wait", type=float, default=90.0,
                   help="per model, total seconds the runner may wait for other processes to go quiet "
                        "before a worker's steps")
    p.add_argument("--clean-threshold", type=float, default=0.10,
                   help="a step is 'clean' when other processes used at most this share of the CPUs meanwhile")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's choice)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--quick", action="store_true",
                   help="pipeline check for CI: tiny model only, 2 timed steps, max-seq-len 64, 128-token "
                        "micro-batches, 1 torch thread, workers started together")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    p.add_argument("--parallel-start", action="store_true",
                   help="start the workers at once (faster; their first_step_s then overlap)")
    p.add_argument("--verbose", action="store_true", help="show the workers' logs")
    p.add_argument("--methods", type=lambda v: [m for m in v.split(",") if m], default=list(METHODS),
                   help=f"comma-separated, from {','.join(METHODS)}; osft, full_ft and peft_osf always run "
                        "(the plain transformers steps hold every position's logits: at large batches they may "
                        "not fit in memory beside the others)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another checkout: its OSFT step runs too (method osft_baseline, interleaved with the rest), "
                        "e.g. a worktree of the commit before a change")
    p.add_argument("--baseline-python", default=None,
                   help="the interpreter for --baseline, one whose osft package is that checkout's "
                        "(default: <baseline>/.venv/bin/python)")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one worker). Returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.spec)
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # keep the table readable in logs
    if args.quick:  # a pipeline check: small batch, 2 timed steps per method (one per round)
        args.models, args.rounds, args.steps = "tiny", 2, 1
        args.max_seq_len, args.max_tokens_per_gpu = 64, 128
        args.parallel_start = True  # start-up times are meaningless here anyway; saves wall time
        args.idle_wait = 0.0
        args.threads = args.threads or 1  # robust on a busy CI machine (2 threads collapse when a core is taken)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        raise SystemExit(f"--models: unknown {bad}; choose from {MODELS}")
    if not 0.0 < args.urr < 1.0:
        raise SystemExit("--urr must be in (0, 1): PEFT's OSF needs at least one frozen direction")
    needed = {"osft", "full_ft", "peft_osf"}
    if set(args.methods) - set(METHODS) or not needed <= set(args.methods):
        raise SystemExit(f"--methods: {args.methods}: choose from {METHODS}, with at least {sorted(needed)}")
    if min(args.steps, args.rounds) < 1:
        raise SystemExit("--steps and --rounds must be >= 1")
    baseline_rev = None
    if args.baseline:
        args.baseline = args.baseline.resolve()
        args.baseline_python = args.baseline_python or str(args.baseline / ".venv" / "bin" / "python")
        if not (args.baseline / "benchmarks" / "bench_step.py").is_file() or not Path(args.baseline_python).exists():
            raise SystemExit(f"--baseline {args.baseline}: needs benchmarks/bench_step.py there and the interpreter "
                             f"{args.baseline_python} (--baseline-python)")
        baseline_rev = git_revision(args.baseline)
        args.methods = [*args.methods, BASELINE_METHOD]
    started = time.time()
    result = dict(benchmark="bench_step", created_unix=started, machine=machine_info(), load_avg_start=os.getloadavg(),
                  settings=dict(models=models, methods=args.methods, steps_per_round=args.steps, rounds=args.rounds, urr=args.urr,
                                batch_size=args.batch_size, max_seq_len=args.max_seq_len,
                                max_tokens_per_gpu=args.max_tokens_per_gpu, dtype="float32", device="cpu",
                                peft_trainable=args.peft_trainable, quick=args.quick, seed=args.seed,
                                parallel_start=args.parallel_start, idle_wait_s=args.idle_wait,
                                clean_threshold=args.clean_threshold, threads=args.threads,
                                data_lines=args.data_lines, optimizer="AdamW, TrainConfig defaults",
                                warmup_steps_untimed=WARMUP_STEPS, order="interleaved rounds: " + " ".join(args.methods),
                                baseline=None if args.baseline is None else dict(path=str(args.baseline), rev=baseline_rev)),
                  models={})
    with tempfile.TemporaryDirectory(prefix="bench_step-") as tmp:
        for name in models:
            result["models"][name] = bench_model(name, args, Path(tmp), console)
    result["wall_s"] = time.time() - started
    result["load_avg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_report(result, console)
    console.print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
