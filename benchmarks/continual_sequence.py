"""Sequence benchmark: T >= 2 tasks learned one after the other, the accuracy matrix R[i][j] per arm.

Every arm starts from the same base model and learns the tasks of a spec in order
(``continual_learning/sequence_tasks.py``: the built-in trivia, FOLDOC, spelled-out numbers and
Roman numerals, or ``--spec FILE`` with a user's tasks), each stage from the export of the stage
before, as a user chains ``osft-train`` runs; every stage has the same steps, batch size, sampler
seed and schedule. After each stage the model is scored on every task's held-out items, so
R[i][j] is task j after stage i (R[0] the base model), in points (``exact``/``format``) or minus the
NLL in nats per token (``nll``); the NLL of every task's reference replies is kept too.

Arms (:data:`ARMS`): sequential full fine-tuning; OSFT at URR 0.25 without protection; OSFT with the
pre-chain-recipe protection (update bases, non-targets trained); OSFT with the default recipe
(nothing set: input bases, GPM criterion, frozen non-targets); replay (full FT with 10 % of each batch
from the earlier tasks' training files, through ``--data-path`` weights); sequential LoRA (PEFT,
merged after each stage); multi-task training on every task at once for T x the steps (the upper
bound, one row); named in ``--arms``, the ablations (:data:`ABLATIONS`: one default of the recipe
flipped each, compared with the default chain) and the ``osft_general`` arms (:data:`GENERAL`: the default
chain after a stage-0 basis, ``osft-train protect-base`` (``osft.trainer.tools.protect_base``): before
the first task the base model's input directions on ``--general-samples`` rows of the demo's
chit-chat training file are protected, Q only, so every stage trains orthogonally to what general
inputs use; ``osft_general_self`` takes no data file: its rows are prompts the base model writes
itself and its replies, ``make-retention-set --self-prompts``; compared with the default chain too). Measures (``continual_learning/matrix.py``): AA, LA,
BWT, FWT, F; goals are paired bootstrap differences (arm - sequential full FT, arm - unprotected
OSFT; an ablation or an ``osft_general`` arm - the default chain), never ratios; each stage's
fold records (``osft_subspaces.json``: median next k_low share, cap binding) are kept in the JSON.

``--probes``: also the probes no arm trains on (``continual_learning/probes.py``: capitals, two-digit
arithmetic, simple instructions, R1 = the base model's own replies) on the base model and after the
last stage, and the recovery check: :data:`RECOVERY_STEPS` steps of the first task from the last
stage's model, then that task scored again (a score that comes back in two steps was alignment, not
knowledge, lost).

``--pilot``: the learning-rate pilot instead of the sequence (``continual_learning/pilot.py``): each
arm of ``--arms`` (default :data:`PILOT_ARMS`; full FT first, the reference) trains the first two
tasks at a few rates on the first seed, scored on validation items (training-file rows no stage
trains on, never the test items); the result holds every rate tried, the one chosen and whether it
is matched to full FT's learning, and a PNG of the learning–forgetting frontier is written beside it.
``--rates PILOT.json`` runs the sequence at the rates a pilot chose.

``--quick``: a tiny random Llama, 1 step per stage, 4 items per task: a pipeline check for CI whose
numbers mean nothing.

Usage::

    python benchmarks/continual_sequence.py --quick --out /tmp/seq.json
    python benchmarks/continual_sequence.py --arms full_ft osft_default --seeds 0 --out /tmp/pilot.json
    python benchmarks/continual_sequence.py --spec my_tasks.json --order b a c
    python benchmarks/continual_sequence.py --merge a.json b.json --out all.json
    python benchmarks/continual_sequence.py --pilot --arms full_ft osft_default lora --out pilot.json
    python benchmarks/continual_sequence.py --rates pilot.json --seeds 0 --out seed0.json
    python benchmarks/continual_sequence.py --rates pilot.json --arms osft_general --seeds 0 --probes --out general.json

``--merge`` combines runs made in parts (some arms or seeds each, same tasks, settings and base
model) into one result with one summary, so the paired differences span every arm.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from machine import machine_info

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
QUICK_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
QUICK_SIZES = {"steps": 1, "batch": 4, "eval_items": 4, "max_new_tokens": 8, "bootstrap": 100, "probe_items": 4,
               "r1_max_new_tokens": 8, "general_samples": 16, "general_new_tokens": 8}
URR = 0.25


@dataclass(frozen=True)
class SequenceArm:
    """One arm: ``name``, ``kind`` (``trainer``, ``peft_lora``; ``multitask`` and ``replay`` are
    trainer runs whose data differ, ``general_basis`` trainer runs chained from a stage-0 basis),
    ``config`` (``TrainConfig`` fields), ``learning_rate`` and, for ``general_basis``, ``general``:
    where its stage-0 rows come from (``chitchat``: the demo's chit-chat training file; ``self``: the
    base model's own prompts and replies, ``make-retention-set --self-prompts``)."""

    name: str
    kind: str
    config: dict
    learning_rate: float
    general: str = "chitchat"


ARMS = [
    SequenceArm("full_ft", "trainer", {"osft": False}, 5e-5),
    SequenceArm("osft_unprotected", "trainer", {"osft_unfreeze_rank_ratio": URR, "osft_protect_subspaces": False}, 1e-4),
    SequenceArm("osft_update", "trainer", {"osft_unfreeze_rank_ratio": URR, "osft_protect_basis": "update",
                                           "freeze_non_target": False}, 1e-4),
    SequenceArm("osft_default", "trainer", {"osft_unfreeze_rank_ratio": URR}, 1e-4),
    SequenceArm("replay", "replay", {"osft": False}, 5e-5),
    SequenceArm("lora", "peft_lora", {"lora_rank": 16}, 2e-4),
    SequenceArm("multitask", "multitask", {"osft": False}, 5e-5),
]
#: Arms that flip one default of the chain recipe each, at the default chain's rate (run when named
#: in ``--arms``; compared with ``osft_default``, paired): update bases instead of input bases, the
#: residual input-energy criterion instead of GPM's total, run 1's frozen count kept instead of the
#: reduced rank's, non-target parameters trained instead of frozen, the fold's cap at k_low instead
#: of floor(0.5·k_low) (``--osft-protect-max-rank-ratio 1``: the energy target ends Q, not the cap).
ABLATIONS = [
    SequenceArm("ablate_update_bases", "trainer", {"osft_unfreeze_rank_ratio": URR, "osft_protect_basis": "update"}, 1e-4),
    SequenceArm("ablate_residual_energy", "trainer",
                {"osft_unfreeze_rank_ratio": URR, "osft_protect_input_criterion": "residual"}, 1e-4),
    SequenceArm("ablate_keep_frozen_rank", "trainer", {"osft_unfreeze_rank_ratio": URR, "osft_frozen_rank": "keep"}, 1e-4),
    SequenceArm("ablate_trained_non_targets", "trainer", {"osft_unfreeze_rank_ratio": URR, "freeze_non_target": False},
                1e-4),
    SequenceArm("ablate_cap1", "trainer", {"osft_unfreeze_rank_ratio": URR, "osft_protect_max_rank_ratio": 1.0}, 1e-4),
]
ABLATION_NAMES = {a.name for a in ABLATIONS}
#: The default chain after a stage-0 basis (run when named in ``--arms``; compared with
#: ``osft_default``, paired, at its rate): before stage 1 the base model directory is copied with
#: protected subspaces P = N×0, Q = the input directions of ``--general-samples`` rows of general
#: chat data (``osft-train protect-base``, :mod:`osft.trainer.tools.protect_base`); stages 1..T then
#: chain from it with the default chain's config. Its stage 1 starts from a directory with
#: subspaces, so, as every chained run, it freezes the non-target parameters, which the default
#: chain's stage 1 trains.
#: ``osft_general_cap1``: the same with the cap of every fold (stage 0 and the stages' exports) at
#: k_low instead of the default floor(0.5·k_low), so the energy target, not the cap, ends Q.
#: ``osft_general_self``: stage 0 on no data file: the rows are ``--general-samples`` prompts the base
#: model writes itself, with its greedy replies (``osft-train make-retention-set --self-prompts``);
#: nothing of the chit-chat source the R1 probe's prompts come from.
GENERAL = [SequenceArm("osft_general", "general_basis", {"osft_unfreeze_rank_ratio": URR}, 1e-4),
           SequenceArm("osft_general_cap1", "general_basis",
                       {"osft_unfreeze_rank_ratio": URR, "osft_protect_max_rank_ratio": 1.0}, 1e-4),
           SequenceArm("osft_general_self", "general_basis", {"osft_unfreeze_rank_ratio": URR}, 1e-4, general="self")]
GENERAL_NAMES = tuple(a.name for a in GENERAL)
#: Arms run only when named in ``--arms``.
OPT_IN = ABLATIONS + GENERAL
#: Arms compared with the default chain (paired differences) that take its pilot rate.
LIKE_DEFAULT = ABLATION_NAMES | {a.name for a in GENERAL}
#: Share of a replay arm's batches drawn from the earlier tasks (split evenly over them).
REPLAY_SHARE = 0.1
#: Optimizer steps of the first task in the recovery check (``--probes``), from the last stage's model.
RECOVERY_STEPS = 2
#: Arms the pilot tunes by default; multi-task training takes full FT's rate (it is full FT on every
#: task at once), an ablation the default chain's.
PILOT_ARMS = ("full_ft", "osft_unprotected", "osft_update", "osft_default", "replay", "lora")
#: Tasks (the first of the order) the pilot trains.
PILOT_TASKS = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny random model, 1 step per stage, 4 items per task")
    p.add_argument("--spec", type=Path, default=None, help="JSON list of task specs (default: the built-in four)")
    p.add_argument("--order", nargs="+", default=None,
                   help="task names in training order, at least 2 (default: every task, in the spec's order)")
    p.add_argument("--arms", nargs="+", choices=[a.name for a in ARMS + OPT_IN], default=None,
                   help="arms to run (default: every arm of ARMS; the ablations and the osft_general arms only when named)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per stage")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eval-items", type=int, default=48, help="held-out items per task")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--probes", action="store_true",
                   help="also score the probes no arm trains on and the recovery check after the last stage")
    p.add_argument("--probe-items", type=int, default=48, help="items per probe (R1: the user turns of this many chit-chat rows)")
    p.add_argument("--r1-max-new-tokens", type=int, default=32, help="length of the base model's R1 replies")
    p.add_argument("--general-samples", type=int, default=64,
                   help="the osft_general arms' stage-0 calibration rows, drawn with the seed from the demo's chit-chat "
                        "training file (never its eval file, which R1 uses), or for osft_general_self the prompts the "
                        "base model writes itself")
    p.add_argument("--general-new-tokens", type=int, default=128,
                   help="osft_general_self: the longest self-written prompt and the longest reply, in tokens")
    p.add_argument("--data-dir", type=Path, default=None, help="where the built-in tasks are built (default: user cache)")
    p.add_argument("--foldoc-dir", type=Path, default=None)
    p.add_argument("--demo-dir", type=Path, default=None, help="demo assets (the base model)")
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="JSON (default results/continual_sequence[_quick].json)")
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                   help="combine these results (same tasks and settings, other arms or seeds) into --out; trains nothing")
    p.add_argument("--markdown", type=Path, default=None, metavar="JSON",
                   help="print the tables of a result or of a pilot (benchmarks/README.md) and exit")
    p.add_argument("--pilot", action="store_true",
                   help="choose each arm's learning rate on the first two tasks' validation items instead of "
                        "running the sequence (default --out results/continual_sequence_lr_pilot.json)")
    p.add_argument("--rates", type=Path, default=None, metavar="PILOT_JSON",
                   help="train each arm at the rate this pilot result chose (others keep their built-in rate)")
    return p


#: An arm whose learning accuracy differs from full FT's by more than this share is marked unmatched.
MATCHED_LA = 0.05


def markdown(result: dict) -> str:
    """The tables of a result, as benchmarks/README.md shows them: per arm its rate, AA, LA, BWT and
    F with their intervals, the paired differences to sequential full FT (an arm whose LA is more than
    :data:`MATCHED_LA` off full FT's is marked unmatched); per arm the matrix R on the scored tasks; the
    paired differences of the ablations and the ``osft_general`` arms to the default chain (their probe
    changes' too); the goal checks; the fold records per stage of the default chain and the arms compared with it;
    the stage-0 basis of the ``osft_general`` arms per unit."""
    def iv(v: dict, sign: bool = False, digits: int = 1) -> str:
        if v["value"] is None:
            return "–"
        f = f"{{:{'+' if sign else ''}.{digits}f}}"
        return f"{f.format(v['value'])} [{f.format(v['low'])}, {f.format(v['high'])}]".replace("-", "−")

    arms, summary = result["arms"], result["summary"]["arms"]
    full_la = summary["full_ft"]["points"]["measures"]["LA"]["value"] if "full_ft" in summary else None
    lines = [f"Units (seeds): {', '.join(result['seeds'])}; {result['settings']['steps']} steps × "
             f"{result['settings']['batch']} per stage; {result['settings']['eval_items']} held-out items per task; "
             f"points on {', '.join(summary[arms[0]]['points']['tasks'])}.", "",
             "| arm | lr | AA | LA | BWT | F | AA − full FT | BWT − full FT |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm in arms:
        m, diff = summary[arm]["points"]["measures"], summary[arm]["points"].get("minus_full_ft", {})
        la = m.get("LA", {"value": None})
        mark = "" if la["value"] is None or not full_la or abs(la["value"] - full_la) <= MATCHED_LA * full_la else " (unmatched)"
        cells = [iv(values[k], sign) if k in values else "–" for values, k, sign in
                 ((m, "AA", False), (m, "LA", False), (m, "BWT", True), (m, "F", False), (diff, "AA", True),
                  (diff, "BWT", True))]
        lines.append(f"| {arm}{mark} | {result['arm_settings'][arm]['learning_rate']:g} | " + " | ".join(cells) + " |")
    lines += ["", "R[i][j], task j after stage i (row 0: the base model), points, the mean over the units:", "",
              "| arm | " + " | ".join(f"after stage {i}" for i in range(len(summary[arms[0]]["points"]["R"]))) + " |",
              "| --- |" + " --- |" * len(summary[arms[0]]["points"]["R"])]
    for arm in arms:
        rows = summary[arm]["points"]["R"]
        lines.append(f"| {arm} | " + " | ".join(", ".join("–" if x != x else f"{x:.1f}" for x in row) for row in rows) + " |")
    ablations = [arm for arm in arms if "minus_osft_default" in summary[arm]["points"]]
    if ablations:
        lines += ["", "One default flipped (ablate_*) or a stage-0 basis added (osft_general*), paired difference to the "
                  "default chain (osft_default):", "",
                  "| arm | AA − default | LA − default | BWT − default |", "| --- | --- | --- | --- |"]
        for arm in ablations:
            diff = summary[arm]["points"]["minus_osft_default"]
            lines.append(f"| {arm} | " + " | ".join(iv(diff[k], True) for k in ("AA", "LA", "BWT")) + " |")
    probes = result["summary"].get("probes")
    if probes:
        base = result["summary"]["probes_base"]
        lines += ["", f"Probes no arm trains on (base model: knowledge {base['knowledge']:.1f}, arithmetic "
                  f"{base['arithmetic']:.1f}, instruction {base['instruction']:.1f} points; R1 NLL {base['r1']:.3f} "
                  f"nats/token): change after the last stage (points; R1: NLL drift, nats/token). Recovery: the first "
                  f"task after {RECOVERY_STEPS} steps of it, gain over the last stage and gap left to right after its "
                  "own stage:", "",
                  "| arm | knowledge | arithmetic | instruction | R1 drift | recovery gain | gap left |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for arm, m in probes.items():
            lines.append(f"| {arm} | " + " | ".join(iv(m[k], True, 3 if k == "r1" else 1) if k in m else "–" for k in
                                                    ("knowledge", "arithmetic", "instruction", "r1", "recovery_gain",
                                                     "recovery_gap")) + " |")
        versus = {arm: m["minus_osft_default"] for arm, m in probes.items() if "minus_osft_default" in m}
        if versus:
            lines += ["", "Probe changes, paired difference to the default chain's:", "",
                      "| arm | knowledge − default | arithmetic − default | instruction − default | R1 drift − default |",
                      "| --- | --- | --- | --- | --- |"]
            for arm, d in versus.items():
                lines.append(f"| {arm} | " + " | ".join(iv(d[k], True, 3 if k == "r1" else 1) for k in
                                                        ("knowledge", "arithmetic", "instruction", "r1")) + " |")
    lines += ["", "| goal | value [95 % interval] | met |", "| --- | --- | --- |"]
    for g in result["summary"]["goals"]:
        digits = 3 if " r1 " in g["check"] else 1  # R1 drift in nats/token, the rest in points
        lines.append(f"| {g['check']} | {iv(g, True, digits)} | {'yes' if g['met'] else 'no' if g['met'] is not None else '–'} |")
    lines += ["", "| arm | unit | stage | modules with input bases | cap bound | median next k_low share |",
              "| --- | --- | --- | --- | --- | --- |"]
    for arm in [a for a in arms if a == "osft_default" or a in LIKE_DEFAULT]:
        for seed in result["seeds"]:
            stages = [s for s in result["stages"][seed].get(arm, []) if "fold" in s and s["task"] != "general"]
            for i, stage in enumerate(stages, 1):
                f = stage["fold"]
                lines.append(f"| {arm} | {seed} | {i} ({stage['task']}) | {f['inputs_modules']} of {f['modules']} | "
                             f"{f['cap_bound_share']:.0%} | {f['median_next_k_low_share']:.2f} |")
    stage0 = [(arm, seed, stages[0]["general_basis"]) for arm in GENERAL_NAMES for seed in result["seeds"]
              if (stages := result["stages"][seed].get(arm)) and "general_basis" in stages[0]]
    if stage0:
        lines += ["", "The stage-0 basis (the base model's input directions on general chat rows):", "",
                  "| arm | unit | rows used of drawn (source) | modules with input bases | p_R median [min, max] | cap bound | "
                  "input energy kept median (lowest) | median next k_low share |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for arm, seed, g in stage0:
            p, e = g["p_right"], g["input_energy_kept"]
            lines.append(f"| {arm} | {seed} | {g['samples_used']} of {g['samples_drawn']} ({g.get('general', 'chitchat')}) | "
                         f"{g['inputs_modules']} of {g['modules']} | "
                         f"{p['median']:g} [{p['min']}, {p['max']}] | {g['cap_bound_share']:.0%} | "
                         f"{e['median']:.3f} ({e['min']:.3f}) | {g['median_next_k_low_share']:.2f} |")
    return "\n".join(lines)


#: Settings that may differ between the parts of a merged result (where they ran, and the modes that train nothing).
PART_SETTINGS = ("arms", "seeds", "work_dir", "out", "merge", "markdown")


#: Relative tolerance of the base model's NLLs that parts of one result must share: a part run with
#: another number of intra-op threads sums in another order and differs in the last digits.
BASE_NLL_RTOL = 1e-4


def _same_base(a: dict, b: dict) -> bool:
    """Whether two base evaluations (task → {"nll": [...], "tokens": [...], "hit": [...]}) agree:
    every value exactly but the NLLs, which agree within :data:`BASE_NLL_RTOL`."""
    if a.keys() != b.keys() or any(a[task].keys() != b[task].keys() for task in a):
        return False
    for task, values in a.items():
        for key, xs in values.items():
            ys = b[task][key]
            agree = (lambda x, y: math.isclose(x, y, rel_tol=BASE_NLL_RTOL)) if key == "nll" else operator.eq
            if len(xs) != len(ys) or not all(map(agree, xs, ys)):
                return False
    return True


def merge(paths: list[Path]) -> dict:
    """One result of the parts in ``paths``: their arms and seeds, the evaluations and stage
    records of each, summarized again (:func:`summarize`); ``wall_s`` is the parts' sum.

    Raises:
        SystemExit: naming the file, when the parts differ in tasks, settings (one a part lacks
            counts as its default) or base evaluation (NLLs within :data:`BASE_NLL_RTOL`),
            hold the same arm and seed twice, or leave an arm without a seed another arm has.
    """
    parts = [(path, json.loads(path.read_text())) for path in paths]
    first_path, first = parts[0]
    defaults = {k: str(v) if isinstance(v, Path) else v for k, v in vars(build_parser().parse_args([])).items()}

    def same(r: dict) -> dict:  # a setting a part lacks was added after it ran: it ran with the default
        return {"settings": {k: v for k, v in {**defaults, **r["settings"]}.items() if k not in PART_SETTINGS},
                "tasks": r["tasks"], "model": r["model"]}

    out = {k: v for k, v in first.items() if k not in ("summary",)}
    out.update(arms=[], seeds=[], evals={"base": first["evals"]["base"]}, stages={}, arm_settings={},
               wall_s=0.0, parts=[str(path) for path in paths])
    for path, r in parts:
        mine, theirs = same(r), same(first)
        differ = [k for k in mine if mine[k] != theirs[k]]
        differ += [] if _same_base(r["evals"]["base"], first["evals"]["base"]) else ["base"]
        if differ:
            raise SystemExit(f"{path}: its {', '.join(differ)} differ from {first_path}'s: not parts of one result")
        out["wall_s"] += r["wall_s"]
        out["arm_settings"].update(r["arm_settings"])
        for seed in r["seeds"]:
            for arm in r["arms"]:
                if arm in out["evals"].get(seed, {}):
                    raise SystemExit(f"{path}: arm {arm}, seed {seed} is in an earlier part too")
                out["evals"].setdefault(seed, {})[arm] = r["evals"][seed][arm]
                out["stages"].setdefault(seed, {})[arm] = r["stages"][seed][arm]
    out["arms"] = [a.name for a in ARMS + OPT_IN if a.name in out["arm_settings"]]
    out["seeds"] = sorted(out["evals"].keys() - {"base"}, key=int)
    for seed in out["seeds"]:
        missing = [arm for arm in out["arms"] if arm not in out["evals"][seed]]
        if missing:
            raise SystemExit(f"seed {seed} has no run of {', '.join(missing)} in {', '.join(map(str, paths))}: "
                             "every arm needs every seed for the paired differences")
    out["settings"] = {**first["settings"], "arms": out["arms"], "seeds": [int(s) for s in out["seeds"]], "merge": out["parts"]}
    out["summary"] = summarize(out)
    return out


def _by_hash(rows: list[dict], n: int) -> list[dict]:
    import hashlib

    return sorted(rows, key=lambda r: hashlib.sha256(json.dumps(r["messages"][0]).encode()).digest())[:n]


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _data_dir(args) -> Path:
    import platformdirs

    return args.data_dir or Path(platformdirs.user_cache_dir("osft")) / "continual"


def _pool_size(args) -> int:
    """Rows of a task's training file its stages draw from: 4x the samples a stage takes."""
    return 4 * args.steps * args.batch


def prepare(args, work: Path) -> tuple[list, dict, Path]:
    """The task specs in order, each task's subsets (train: 4x the samples a stage draws; eval items)
    under ``work``, and the base model directory."""
    from continual_learning.sequence_tasks import builtin_specs, read_specs

    specs = read_specs(args.spec) if args.spec else builtin_specs(_data_dir(args), args.foldoc_dir)
    if args.order:
        by_name = {s.name: s for s in specs}
        if len(set(args.order)) != len(args.order) or len(args.order) < 2 or not set(args.order) <= set(by_name):
            raise ValueError(f"--order {' '.join(args.order)} must name at least 2 of {', '.join(by_name)}, each once")
        specs = [by_name[n] for n in args.order]
    files = {}
    for s in specs:
        train = _write(work / f"{s.name}.train.jsonl", _by_hash(_read(s.train), _pool_size(args)))
        files[s.name] = {"train": train, "eval": _by_hash(_read(s.eval), args.eval_items)}
    if args.quick:
        sys.path.insert(0, str(REPO / "tests"))
        from helpers import save_tiny_model

        base = save_tiny_model(work / "tiny-llama", generation_ids=True, **QUICK_MODEL)
    else:
        from assets import demo_assets

        base = demo_assets(args.demo_dir).model_dir
    return specs, files, base


def evaluate(model_dir: Path, specs, files: dict, args) -> dict:
    """Per task: ``nll``/``tokens`` per item (reference replies) and, for ``exact``/``format``, ``hit`` per item."""
    import torch
    from continual_learning.evaluate import sample_nll
    from continual_learning.trivia import is_compliant
    from osft.trainer.data.tokenize import tokenize_chat_file
    from osft.trainer.model.loading import load_model, load_tokenizer
    from osft.trainer.tools.retention_set import greedy_replies

    model = load_model(model_dir, torch.float32, "cpu").eval()
    tokenizer = load_tokenizer(model_dir)
    out = {}
    for s in specs:
        rows = files[s.name]["eval"]
        path = _write(Path(tempfile.mkdtemp()) / "eval.jsonl", rows)
        tok = tokenize_chat_file(path, tokenizer, args.max_seq_len, "truncate")
        nll, tokens = sample_nll(model, [tok[i] for i in range(len(tok))], args.max_tokens)
        shutil.rmtree(path.parent)
        item = {"nll": [round(float(x), 5) for x in nll], "tokens": [int(t) for t in tokens]}
        if s.metric != "nll":
            replies = greedy_replies(model, tokenizer, [r["messages"][0]["content"] for r in rows], args.max_new_tokens,
                                     args.gen_batch)
            refs = [r["messages"][1]["content"] for r in rows]
            if s.metric == "format":
                item["hit"] = [int(is_compliant(r)) for r in replies]
            else:
                item["hit"] = [int(" ".join((r.splitlines() or [""])[0].split()) == " ".join(ref.split()))
                               for r, ref in zip(replies, refs)]
        out[s.name] = item
    del model
    return out


def prepare_probes(args, work: Path, base: Path) -> dict:
    """The probes of ``--probes``: ``items``, the generated ones
    (:func:`continual_learning.probes.build_probes`, ``--probe-items`` each), and ``r1``, the base
    model's greedy replies to the user turns of ``--probe-items`` held-out chit-chat rows (the demo's
    eval file), tokenized as the trainer does (a reply that comes out empty is dropped)."""
    from assets import demo_assets
    from continual_learning.probes import build_probes
    from osft.trainer.data.tokenize import tokenize_chat_file
    from osft.trainer.model.loading import load_tokenizer
    from osft.trainer.tools.retention_set import chat_prompts, make_retention_set

    prompts, lines = chat_prompts(demo_assets(args.demo_dir).eval_path, args.probe_items)
    make_retention_set(base, work / "r1.jsonl", prompts, args.r1_max_new_tokens, args.gen_batch, source_lines=lines)
    r1 = tokenize_chat_file(work / "r1.jsonl", load_tokenizer(base), args.max_seq_len, "truncate")
    return {"items": build_probes(_data_dir(args), args.probe_items), "r1": [r1[i] for i in range(len(r1))]}


def evaluate_probes(model_dir: Path, probes: dict, args) -> dict:
    """Per probe of :func:`prepare_probes`: ``hit`` per item (0/1, the greedy reply by
    :func:`continual_learning.probes.hit`); ``r1``: ``nll``/``tokens`` per item."""
    import torch
    from continual_learning.evaluate import sample_nll
    from continual_learning.probes import hit
    from osft.trainer.model.loading import load_model, load_tokenizer
    from osft.trainer.tools.retention_set import greedy_replies

    model = load_model(model_dir, torch.float32, "cpu").eval()
    tokenizer = load_tokenizer(model_dir)
    out = {}
    for name, items in probes["items"].items():
        replies = greedy_replies(model, tokenizer, [i.prompt for i in items], args.max_new_tokens, args.gen_batch)
        out[name] = {"hit": [int(hit(i, r)) for i, r in zip(items, replies)]}
    nll, tokens = sample_nll(model, probes["r1"], args.max_tokens)
    out["r1"] = {"nll": [round(float(x), 5) for x in nll], "tokens": [int(t) for t in tokens]}
    del model
    return out


def fold_record(export: Path) -> dict | None:
    """The chain-health summary of an export's ``osft_subspaces.json`` (None without one)."""
    path = Path(export) / "osft_subspaces.json"
    if not path.is_file():
        return None
    modules = json.loads(path.read_text())["modules"].values()
    ratios = [m["next_k_low"] / m["fresh_k_low"] for m in modules if m.get("fresh_k_low")]
    return {"modules": len(modules), "median_next_k_low_share": statistics.median(ratios) if ratios else None,
            "cap_bound_share": sum(bool(m["cap_bound"] or m.get("input_cap_bound")) for m in modules) / len(modules),
            "min_energy_kept": min(m["energy_kept"] for m in modules),
            "inputs_modules": sum(m.get("basis") == "inputs" for m in modules)}


def _spec(arm: SequenceArm):
    from continual_learning.methods import Spec

    return Spec("peft_lora" if arm.kind == "peft_lora" else "trainer", arm.config, arm.learning_rate)


def _phase(name: str, data, steps: int, args, seed: int):
    from continual_learning.methods import Phase

    return Phase(name, data, steps, args.batch, args.max_seq_len, args.max_tokens, "constant", 0, seed)


def run_arm(arm: SequenceArm, specs, files: dict, base: Path, work: Path, args, seed: int,
            probes: dict | None = None) -> tuple[dict, list]:
    """Train ``arm`` through the sequence; returns its evaluations by stage (``"1"``..``"T"``; the
    multi-task arm only ``"T"``) and the stages' records (seconds, fold records; an ``osft_general`` arm's
    list starts with its stage 0, task ``general``: the seconds it took, its fold record and
    ``general_basis``, :func:`osft.trainer.tools.protect_base.write_protected_base`'s record). With ``probes``
    (:func:`prepare_probes`) the evaluations also hold ``"probes"`` (:func:`evaluate_probes` of the
    last model) and, but for the multi-task arm, ``"recovery"``: the first task scored after
    :data:`RECOVERY_STEPS` steps of it from the last model."""
    from continual_learning.methods import train_phase

    evals, stages, model = {}, [], base
    if arm.kind == "multitask":
        data = [f"{files[s.name]['train']}:1" for s in specs]
        out = train_phase(_spec(arm), _phase("all", data, len(specs) * args.steps, args, seed), base, work / "mt",
                          work / "cache")
        evals[str(len(specs))] = evaluate(out["model_dir"], specs, files, args)
        if probes is not None:
            evals["probes"] = evaluate_probes(out["model_dir"], probes, args)
        stages.append({"task": "all", "train_s": out["setup_s"] + out["train_s"], "fold": None})
        shutil.rmtree(work / "mt")
        return evals, stages
    if arm.kind == "general_basis":
        stage0 = general_basis(arm, base, work, args, seed)
        stages.append({"task": "general", "train_s": stage0["record"]["seconds"], "fold": fold_record(stage0["dir"]),
                       "general_basis": stage0["record"]})
        model = stage0["dir"]
    for i, s in enumerate(specs):
        data = files[s.name]["train"]
        if arm.kind == "replay" and i:
            share = REPLAY_SHARE / i
            data = [f"{data}:{1 - REPLAY_SHARE}", *(f"{files[p.name]['train']}:{share}" for p in specs[:i])]
        out = train_phase(_spec(arm), _phase(s.name, data, args.steps, args, seed), model, work / f"{arm.name}-{i}",
                          work / "cache")
        evals[str(i + 1)] = evaluate(out["model_dir"], specs, files, args)
        stages.append({"task": s.name, "train_s": out["setup_s"] + out["train_s"], "fold": fold_record(out["model_dir"]),
                       "ortho_violations": out["ortho_violations"]})
        if i:
            shutil.rmtree(work / f"{arm.name}-{i - 1}")
        elif arm.kind == "general_basis":
            shutil.rmtree(model)
        model = out["model_dir"]
    if probes is not None:
        evals["probes"] = evaluate_probes(model, probes, args)
        first = specs[0]
        out = train_phase(_spec(arm), _phase(f"{first.name}-recovery", files[first.name]["train"], RECOVERY_STEPS, args,
                                             seed), model, work / f"{arm.name}-recovery", work / "cache")
        evals["recovery"] = evaluate(out["model_dir"], [first], files, args)
        shutil.rmtree(work / f"{arm.name}-recovery")
    shutil.rmtree(work / f"{arm.name}-{len(specs) - 1}")
    return evals, stages


def general_basis(arm: SequenceArm, base: Path, work: Path, args, seed: int) -> dict:
    """Stage 0 of ``arm`` (an ``osft_general`` arm): ``dir``, the base model with the protected input
    directions of ``--general-samples`` general chat rows drawn with ``seed``, written under ``work``
    by :func:`osft.trainer.tools.protect_base.write_protected_base` (what ``osft-train protect-base``
    runs) with the arm's config and the stages' sequence lengths and micro-batches, and its
    ``record`` (with ``general``: the rows' source, and for ``self`` ``self_rows`` and
    ``self_seconds``). The rows: the demo's chit-chat training file, or (``arm.general`` ``self``) a
    file of that many prompts the base model writes itself and its greedy replies, of at most
    ``--general-new-tokens`` tokens each (:func:`osft.trainer.tools.retention_set.make_retention_set`)."""
    from assets import demo_assets
    from continual_learning.methods import _train_config

    from osft.trainer.tools.protect_base import write_protected_base
    from osft.trainer.tools.retention_set import make_retention_set

    spec = _spec(arm)
    spec = replace(spec, config={**spec.config, "osft_protect_input_samples": args.general_samples})
    out = work / f"{arm.name}-general"
    if arm.general == "self":
        start = time.perf_counter()
        made = make_retention_set(base, work / f"{arm.name}-general.jsonl", [], args.general_new_tokens,
                                  args.gen_batch, seed, self_prompts=args.general_samples)
        data = made.out_path
        extra = {"self_rows": made.rows, "self_seconds": round(time.perf_counter() - start, 1)}
    else:
        data, extra = demo_assets(args.demo_dir).train_path, {}
    cfg = _train_config(spec, _phase("general", data, 1, args, seed), base, out, work / "cache", arm.learning_rate)
    return {"dir": out, "record": {**write_protected_base(cfg), "general": arm.general, **extra}}


#: Goals for the default recipe (reported, never asserted): (check, arm A, factor, arm B, bound): the
#: paired difference A − factor·B of the points matrix's measure must be at least ``bound`` (at most,
#: for the headroom check on full FT's own BWT: arm B None).
GOALS = (("BWT", "full_ft", 0, None, None, -15), ("BWT", "osft_default", 0, None, -3, None),
         ("BWT", "osft_default", 1, "full_ft", 0, None), ("BWT", "osft_default", 1, "osft_unprotected", 0, None),
         ("LA", "osft_default", 0.9, "full_ft", 0, None), ("AA", "osft_default", 1, "full_ft", 10, None),
         ("AA", "osft_default", 1, "lora", 0, None), ("AA", "osft_default", 1, "replay", -3, None),
         ("AA", "osft_default", 0.85, "multitask", 0, None))


#: Goals on the probes (``--probes``), for the default recipe and the chain after a stage-0 basis
#: (:data:`PROBE_GOAL_ARMS`): (probe, factor, arm B, at least, at most) on the change from the base
#: model (points; R1: its drift, nats/token, lower is better).
PROBE_GOALS = (("r1", 0.5, "full_ft", None, 0), ("knowledge", 0, None, -3, None), ("arithmetic", 0, None, -3, None))
PROBE_GOAL_ARMS = ("osft_default", *GENERAL_NAMES)


def summarize(result: dict) -> dict:
    """Per arm and matrix (``points``: the tasks scored by exact match or format, in points; ``nll``:
    every task, minus the reference NLL in nats per token) the point matrix R, the measures (AA, LA,
    BWT, FWT, F) with 95 % paired bootstrap intervals and their differences to ``full_ft`` and
    ``osft_unprotected`` (those of :data:`LIKE_DEFAULT` to ``osft_default`` too); and the goal checks
    on the points matrix (:data:`GOALS`). With probes (``probes_base`` in the result): per arm the
    change of each probe from the base model (points; ``r1``: the NLL drift, nats per token), the
    recovery check's ``recovery_gain`` (the first task's score after the recovery steps minus after
    the last stage) and ``recovery_gap`` (right after its own stage minus after recovery), their
    differences to full FT (and, for :data:`LIKE_DEFAULT`, to the default chain), and the goals of
    :data:`PROBE_GOALS` for each arm of :data:`PROBE_GOAL_ARMS` run."""
    import numpy as np
    from continual_learning.matrix import sequence_measures
    from continual_learning.stats import Bootstrap, interval

    names = [t["name"] for t in result["tasks"]]
    metrics = {t["name"]: t["metric"] for t in result["tasks"]}
    seeds, T = result["seeds"], len(names)
    base = result["evals"]["base"]
    sizes = {**{f"{n}:nll": len(base[n]["nll"]) for n in names},
             **{f"{n}:hit": len(base[n]["hit"]) for n in names if "hit" in base[n]}}
    probes_base = {f"probe.{k}": v for k, v in result.get("probes_base", {}).items()}
    sizes.update({f"{n}:{key}": len(v[key]) for n, v in probes_base.items() for key in ("hit", "nll") if key in v})
    boot = Bootstrap(len(seeds), sizes, result["settings"]["bootstrap"])
    empty = np.full(boot.seeds.shape[0], np.nan)

    def score(evals: list[dict | None], task: str, kind: str) -> np.ndarray:
        if not all(evals):
            return empty
        if kind == "nll":
            return -boot.mean(f"{task}:nll", np.array([e[task]["nll"] for e in evals], float),
                              np.array([e[task]["tokens"] for e in evals], float))
        return 100 * boot.mean(f"{task}:hit", np.array([e[task]["hit"] for e in evals], float))

    columns = {"points": [j for j, n in enumerate(names) if metrics[n] != "nll"], "nll": list(range(T))}
    out: dict = {arm: {} for arm in result["arms"]}
    replicates: dict = {}
    for kind, cols in columns.items():
        if len(cols) < 2 and kind == "points":
            continue
        for arm in result["arms"]:
            stages = [[base] * len(seeds)] + [[result["evals"][s][arm].get(str(i)) for s in seeds] for i in range(1, T + 1)]
            R = np.moveaxis(np.array([[score(row, names[j], kind) for j in cols] for row in stages]), -1, 0)
            m = sequence_measures(R, [j + 1 for j in cols]) if arm != "multitask" else {"AA": R[:, T].mean(-1)}
            replicates[(kind, arm)] = m
            out[arm][kind] = {"tasks": [names[j] for j in cols], "R": np.round(R[0], 3).tolist(),
                              "measures": {k: interval(v) for k, v in m.items()}}
        for arm in result["arms"]:
            for ref in ("full_ft", "osft_unprotected") + (("osft_default",) if arm in LIKE_DEFAULT else ()):
                if (kind, ref) in replicates and arm not in (ref, "multitask"):
                    out[arm][kind][f"minus_{ref}"] = {k: interval(v - replicates[(kind, ref)][k])
                                                      for k, v in replicates[(kind, arm)].items()}
    goals = []

    def check(what: str, diff: np.ndarray, at_least: float | None, at_most: float | None) -> None:
        iv = interval(diff)
        met = None if iv["value"] is None else (iv["value"] >= at_least if at_least is not None else iv["value"] <= at_most)
        goals.append({"check": what + (f" >= {at_least:g}" if at_least is not None else f" <= {at_most:g}"),
                      **iv, "met": met, "interval_clear": None if iv["low"] is None else
                      (iv["low"] > at_least if at_least is not None else iv["high"] < at_most)})

    for measure, arm, factor, ref, at_least, at_most in GOALS:
        if ("points", arm) not in replicates or (ref and ("points", ref) not in replicates):
            continue
        diff = replicates[("points", arm)][measure] - (factor * replicates[("points", ref)][measure] if ref else 0)
        check(f"{arm} {measure}" + (f" - {factor:g} x {ref}'s" if ref else ""), diff, at_least, at_most)
    if not probes_base:
        return {"arms": out, "goals": goals}
    kinds = {name: "nll" if "nll" in v else "hit" for name, v in probes_base.items()}
    at_base = {name: score([probes_base] * len(seeds), name, kind) for name, kind in kinds.items()}
    probes = {arm: m for arm in result["arms"] if (m := _probe_changes(result, arm, at_base, kinds, score))}
    table = {arm: {k: interval(v) for k, v in m.items()} for arm, m in probes.items()}
    for arm, m in probes.items():
        for ref in ("full_ft",) + (("osft_default",) if arm in LIKE_DEFAULT else ()):
            if ref in probes and arm != ref:
                table[arm][f"minus_{ref}"] = {k: interval(v - probes[ref][k]) for k, v in m.items() if k in probes[ref]}
    for arm in PROBE_GOAL_ARMS:
        for measure, factor, ref, at_least, at_most in PROBE_GOALS:
            if arm not in probes or (ref and ref not in probes):
                continue
            check(f"{arm} {measure} {'drift' if measure == 'r1' else 'change'}" + (f" - {factor:g} x {ref}'s" if ref else ""),
                  probes[arm][measure] - (factor * probes[ref][measure] if ref else 0), at_least, at_most)
    return {"arms": out, "goals": goals, "probes": table,
            "probes_base": {n.removeprefix("probe."): float(v[0]) * (-1 if kinds[n] == "nll" else 1) for n, v in at_base.items()}}


def _probe_changes(result: dict, arm: str, at_base: dict, kinds: dict, score) -> dict | None:
    """Replicates of ``arm``'s probe changes from the base model (``at_base``: each probe's
    replicates there; ``kinds``: ``hit`` or ``nll`` per probe; ``score``: :func:`summarize`'s), its
    R1 drift, and with a recovery check its ``recovery_gain`` and ``recovery_gap``; None for an arm
    run without probes."""
    evals = [result["evals"][s][arm] for s in result["seeds"]]
    if not all("probes" in e for e in evals):
        return None
    after = [{f"probe.{k}": v for k, v in e["probes"].items()} for e in evals]
    out = {name.removeprefix("probe."): score(after, name, kind) - at_base[name] for name, kind in kinds.items()}
    out["r1"] = -out["r1"]  # the drift: NLL after - NLL before
    if all("recovery" in e for e in evals):
        first = result["tasks"][0]
        kind = "nll" if first["metric"] == "nll" else "hit"
        now = score([e["recovery"] for e in evals], first["name"], kind)
        out["recovery_gain"] = now - score([e[str(len(result["tasks"]))] for e in evals], first["name"], kind)
        out["recovery_gap"] = score([e["1"] for e in evals], first["name"], kind) - now
    return out


def with_rates(arms: list[SequenceArm], path: Path) -> list[SequenceArm]:
    """``arms`` at the rates the pilot result at ``path`` chose: an arm it tuned takes its choice, an
    ablation and the ``osft_general`` arms (:data:`LIKE_DEFAULT`) the default chain's, multi-task training
    full FT's; any other arm keeps its own."""
    chosen = {arm: row["chosen"] for arm, row in json.loads(Path(path).read_text())["arms"].items()}

    def rate(arm: SequenceArm) -> float:
        like = "osft_default" if arm.name in LIKE_DEFAULT else "full_ft" if arm.kind == "multitask" else arm.name
        return chosen.get(arm.name, chosen.get(like, arm.learning_rate))

    return [replace(arm, learning_rate=rate(arm)) for arm in arms]


def validation(specs, files: dict, args) -> dict:
    """Per task of ``specs``: its stages' training pool (``train``, as :func:`prepare` made it) and
    ``eval``, ``--eval-items`` validation rows: the training file's rows right after the pool in hash
    order, so never trained on.

    Raises:
        SystemExit: naming the file, when it has too few rows or a validation prompt is a test item's.
    """
    pool = _pool_size(args)
    out = {}
    for s in specs:
        rows = _by_hash(_read(s.train), pool + args.eval_items)[pool:]
        test = {json.dumps(r["messages"][0]) for r in files[s.name]["eval"]}
        if len(rows) < args.eval_items:
            raise SystemExit(f"{s.train}: {pool + len(rows)} rows, the pilot needs {pool + args.eval_items} "
                             f"(a training pool of {pool} and {args.eval_items} validation items)")
        if any(json.dumps(r["messages"][0]) in test for r in rows):
            raise SystemExit(f"{s.train}: a validation prompt is also a test item of {s.eval}")
        out[s.name] = {"train": files[s.name]["train"], "eval": rows}
    return out


def _header(benchmark: str, started: float, args, specs) -> dict:
    """What every result of this script starts with: its name, when and where it ran, the model,
    the settings and the tasks."""
    return {"benchmark": benchmark, "created_unix": started, "wall_s": time.time() - started,
            "machine": machine_info(), "model": "tiny random Llama" if args.quick else "SmolLM2-135M-Instruct",
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "tasks": [{"name": s.name, "metric": s.metric} for s in specs]}


def _nll_scores(evals: dict, names: list[str]) -> list[float]:
    """Minus each task's reference NLL (nats per token) in one evaluation."""
    return [-sum(evals[n]["nll"]) / sum(evals[n]["tokens"]) for n in names]


def run_pilot(args, arms: list[SequenceArm], console) -> dict:
    """The learning-rate pilot (``continual_learning/pilot.py``) of ``arms`` (full FT first) on the
    first :data:`PILOT_TASKS` tasks' validation items, seed ``args.seeds[0]``: per arm every rate
    tried with its NLL matrix, learning gain, BWT and evaluations, the rate chosen, its gain and
    whether it is matched to full FT's.

    Raises:
        SystemExit: full FT is not the first arm, or multi-task training is among them.
    """
    import numpy as np
    from continual_learning import pilot
    from continual_learning.matrix import sequence_measures

    if arms[0].name != "full_ft" or any(a.kind == "multitask" for a in arms):
        raise SystemExit("--pilot: --arms must start with full_ft (the others are matched to its learning) "
                         "and cannot hold multitask (it takes full FT's rate)")
    started, seed = time.time(), args.seeds[0]
    work = Path(tempfile.mkdtemp(prefix="osft-pilot-", dir=args.work_dir))
    try:
        specs, files, base = prepare(args, work)
        specs = specs[:PILOT_TASKS]
        names = [s.name for s in specs]
        valid = validation(specs, files, args)
        base_eval = evaluate(base, specs, valid, args)
        rows, target = {}, None
        for arm in arms:
            tried, todo = {}, pilot.first_grid(arm.learning_rate)
            for _ in range(pilot.MAX_EXTENSIONS + 1):
                for lr in todo:
                    t = time.time()
                    evals, stages = run_arm(replace(arm, learning_rate=lr), specs, valid, base, work, args, seed)
                    R = np.array([_nll_scores(base_eval, names)] + [_nll_scores(evals[str(i)], names)
                                                                    for i in range(1, len(specs) + 1)])
                    m = sequence_measures(R)
                    tried[lr] = {"learning_rate": lr, "gain": float(m["LA"] - R[0].mean()), "BWT": float(m["BWT"]),
                                 "R_nll": np.round(R, 5).tolist(), "evals": evals,
                                 "train_s": [st["train_s"] for st in stages]}
                    console.print(f"pilot {arm.name} lr {lr:.3g}: gain {tried[lr]['gain']:.3f}, BWT "
                                  f"{tried[lr]['BWT']:+.3f} nats/token ({time.time() - t:.0f} s)")
                gains = {lr: v["gain"] for lr, v in tried.items()}
                nxt = pilot.next_rate(gains, target)
                if nxt is None:
                    break
                todo = [nxt]
            chosen = pilot.choose(gains, target)
            target = gains[chosen] if target is None else target
            rows[arm.name] = {"start": arm.learning_rate, "chosen": chosen, "gain": gains[chosen],
                              "matched": pilot.matched(gains[chosen], target),
                              "tried": [tried[lr] for lr in sorted(tried)]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**_header("continual_sequence_lr_pilot", started, args, specs), "validation_items": args.eval_items,
            "seed": seed, "base": base_eval, "arms": rows}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    if args.quick:
        for k, v in QUICK_SIZES.items():
            setattr(args, k, v)
    name = "continual_sequence_lr_pilot" if args.pilot else "continual_sequence"
    args.out = args.out or RESULTS / f"{name}{'_quick' if args.quick else ''}.json"
    console = Console(stderr=True)
    if args.markdown:
        from continual_learning import pilot

        shown = json.loads(args.markdown.read_text())
        print(pilot.markdown(shown) if shown["benchmark"] == "continual_sequence_lr_pilot" else markdown(shown))
        return 0
    if args.merge:
        result = merge(args.merge)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        report(result, args.out, console)
        return 0
    if args.pilot:
        from continual_learning import pilot

        named = args.arms or PILOT_ARMS
        result = run_pilot(args, [a for a in ARMS + OPT_IN if a.name in named], console)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        pilot.plot_frontier(result["arms"], args.out.with_suffix(".png"))
        console.print(pilot.markdown(result))
        console.print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({result['wall_s']:.0f} s)")
        return 0
    arms = [a for a in ARMS + OPT_IN if (a.name in args.arms if args.arms else a in ARMS)]
    if args.rates:
        arms = with_rates(arms, args.rates)
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="osft-sequence-", dir=args.work_dir))
    try:
        specs, files, base = prepare(args, work)
        evals = {"base": evaluate(base, specs, files, args)}
        probes = prepare_probes(args, work, base) if args.probes else None
        probes_base = evaluate_probes(base, probes, args) if probes else None
        stages = {}
        for seed in args.seeds:
            evals[str(seed)], stages[str(seed)] = {}, {}
            for arm in arms:
                t = time.time()
                evals[str(seed)][arm.name], stages[str(seed)][arm.name] = run_arm(arm, specs, files, base, work, args, seed,
                                                                                   probes)
                console.print(f"seed {seed}, {arm.name}: {time.time() - t:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {**_header("continual_sequence", started, args, specs), "arms": [a.name for a in arms],
              "arm_settings": {a.name: {"kind": a.kind, "config": a.config, "learning_rate": a.learning_rate}
                               for a in arms},
              "seeds": [str(s) for s in args.seeds], "evals": evals, "stages": stages}
    if probes_base is not None:
        result["probes_base"] = probes_base
    result["summary"] = summarize(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    report(result, args.out, console)
    return 0


def report(result: dict, out: Path, console) -> None:
    """Print each arm's measures and each goal's check, then where the result was written."""
    for arm, kinds in result["summary"]["arms"].items():
        for kind, row in kinds.items():
            console.print(f"{arm:18s} {kind:6s} " + "  ".join(f"{k} {v['value']:+.2f}" for k, v in row["measures"].items()
                                                           if v["value"] is not None))
    for g in result["summary"]["goals"]:
        console.print(f"goal {g['check']}: {g['value']} [{g['low']}, {g['high']}] met={g['met']}")
    console.print(f"wrote {out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
