"""``osft-train estimate-memory MODEL``: the peak memory per rank of a run, before launching it.

From the model's config alone (a meta-device model, :func:`osft.trainer.model.build.meta_model`; no weights read)
and the run's settings, per rank, in bytes:

- ``trainable``: the parameters AdamW updates (float32, sharded over the world size W by FSDP2):
  per OSFT target U_low (N×k_low), S_low, V_low (k_low×M); every other parameter (embeddings, norms,
  an untied LM head); with ``--no-osft`` every parameter.
- ``frozen``: per OSFT target W_high (N×M), the projection bases (remove mode N×(p_L + k_high) and
  (p_R + k_high)×M, keep mode N×k_low and k_low×M, :func:`.osft.plan.plan_module`), P (N×p_L),
  Q (M×p_R), the start copies of the low factors; float32, sharded.
- ``gradients``: one float32 gradient per trainable value, sharded; ``adamw``: two states per value.
- ``gathered``: with W > 1, FSDP2's all-gathered block in the compute dtype, this block and the next
  (prefetch): twice the largest block's parameters.
- ``v_cache``: with W > 1 and ``cache_v`` (the default on CPU), every target's all-gathered V basis,
  kept whole on every rank (float32).
- ``activations``: what backward needs, per token of the micro-batch T (``--max-tokens-per-gpu``):
  per decoder layer ≈ (7·H + 2·kv + 4·I) values in the compute dtype (norm inputs and outputs, q/k/v,
  the attention output, the MLP's gate, up, activation and product), plus the N×M weight each
  target of the ``dense``/``hybrid`` forward form rebuilds (held from forward to backward); with
  activation checkpointing only each layer's input (H per token) and one layer's full set.
- ``logits``: float32 logits and their gradient for T positions over the vocabulary (an upper
  bound: only the trained positions reach the LM head).
- ``runtime``: on CPU the process itself (Python, torch, transformers and the trainer imported,
  :data:`CPU_RUNTIME_BYTES`); 0 on CUDA (``torch.cuda.max_memory_allocated`` counts tensors only).
- ``loaded``: on CPU with W > 1, the whole model as each rank loads it before FSDP2 shards it
  (float32): freed after sharding, but kept by the allocator in the process's resident memory; 0 on
  CUDA and on one rank.

The HF export at the end of a run (:class:`osft.trainer.checkpoint.export.Exporter`) holds,
beside the training state (trainable, frozen, gradients, AdamW, the cache), in place of the
activations and logits:

- ``export_state``: with W > 1, rank 0's gathered copy of the whole model (every OSFT factor and
  every other parameter, float32);
- ``input_grams``: the input bases' M×M float64 Grams (every trainable target but expert banks
  under ``--osft-protect-basis auto``/``inputs``, :func:`osft.trainer.osft.input_grams.gram_bytes`),
  at most ``--osft-protect-input-memory-gb`` at once, on every rank;
- ``export_weights``: rank 0's dense weights (float32, W_high + U_low·S_low·V_low per target; a
  ``--no-osft`` run's are its parameters) and their copy in the saved dtype.

The peak per rank (:attr:`MemoryPlan.total`) is the larger phase: :attr:`MemoryPlan.training` or
:attr:`MemoryPlan.export`.

Checked against measured peaks in ``benchmarks/results/memory_plan.json`` (CPU RSS of real runs)
and by ``benchmarks/gpu_check.py`` (``gpu_mem_bytes``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

#: Resident memory of a CPU rank before any model tensor (Python, torch, transformers, the trainer).
CPU_RUNTIME_BYTES = 550 * 2**20
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank of each part (see the module docstring): the training phase's peak
    :attr:`training`, the export's :attr:`export`, and the larger, :attr:`total`."""

    trainable: int
    frozen: int
    gradients: int
    adamw: int
    gathered: int
    v_cache: int
    activations: int
    logits: int
    runtime: int
    loaded: int = 0
    export_state: int = 0
    input_grams: int = 0
    export_weights: int = 0

    @property
    def resident(self) -> int:
        """What both phases hold: the training state, the cache, the runtime and the loaded model."""
        return (self.trainable + self.frozen + self.gradients + self.adamw + self.gathered + self.v_cache + self.runtime
                + self.loaded)

    @property
    def training(self) -> int:
        """The peak of a training step."""
        return self.resident + self.activations + self.logits

    @property
    def export(self) -> int:
        """The peak of the HF export (on rank 0)."""
        return self.resident + self.export_state + self.input_grams + self.export_weights

    @property
    def total(self) -> int:
        return max(self.training, self.export)

    @property
    def phase(self) -> str:
        """Where the peak is: ``training`` or ``export``."""
        return "export" if self.export > self.training else "training"

    def verdict(self, device_bytes: float | None) -> str:
        """One line: the peak per rank (and its phase), and against ``device_bytes`` whether it fits."""
        peak = f"peak per rank ≈ {self.total / 2**30:.2f} GiB ({self.phase})"
        if not device_bytes:
            return peak
        share = self.total / device_bytes
        if share <= 0.9:
            return f"fits: {peak} of {device_bytes / 2**30:.1f} GiB ({share:.0%})"
        hint = ("activation checkpointing, " if self.activations > self.trainable else "") + "more ranks or fewer tokens per GPU"
        return f"does not fit: {peak}, {share:.0%} of {device_bytes / 2**30:.1f} GiB (over 90 %); try {hint}"


def _layer_dims(config) -> tuple[int, int, int, int, int]:
    """(H, kv width, I, layers, vocab) of a decoder config."""
    text = getattr(config, "text_config", None) or config
    h = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 1))
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads) * head_dim
    inter = int(getattr(text, "intermediate_size", None) or 4 * h)
    return h, kv, inter, int(text.num_hidden_layers), int(text.vocab_size)


def estimate(model_path: str, *, osft: bool = True, urr: float = 0.25, protected: dict[str, tuple[int, int]] | None = None,
             dtype: str = "float32", world_size: int = 1, tokens_per_gpu: int = 2048,
             activation_checkpointing: bool = False, cache_v: bool | None = None, device: str = "cpu",
             target_patterns: list[str] | None = None, protect_basis: str = "auto", input_memory_gb: float = 4.0,
             save_dtype: str = "bfloat16") -> MemoryPlan:
    """The :class:`MemoryPlan` of a run (see the module docstring).

    Args:
        model_path: a model directory (its ``config.json`` is read).
        protected: (p_L, p_R) per target from earlier runs (None: :func:`protected_ranks` of ``model_path``).
        dtype: the compute dtype (``float32`` on CPU, ``bfloat16`` on CUDA).
        cache_v: keep the all-gathered V bases (None: on CPU yes, on CUDA no, as the trainer does).
        protect_basis, input_memory_gb: ``--osft-protect-basis`` and ``--osft-protect-input-memory-gb``
            (the export's input Grams). save_dtype: ``--save-dtype``.

    Raises:
        ValueError: an unknown dtype or a URR outside (0, 1).
    """
    from ..model.build import meta_model, target_shapes
    from ..model.loading import load_config
    from ..osft.input_grams import gram_bytes
    from ..osft.plan import plan_module

    if dtype not in _BYTES or save_dtype not in _BYTES:
        raise ValueError(f"dtype and save dtype must be one of {', '.join(_BYTES)}, got {dtype!r}, {save_dtype!r}")
    if not 0 < urr < 1:
        raise ValueError(f"the URR must be in (0, 1), got {urr}")
    b, w = _BYTES[dtype], max(1, world_size)
    model = meta_model(model_path)
    total_params = sum(p.numel() for p in model.parameters())
    shapes = target_shapes(model_path, target_patterns) if osft else {}
    protected = protected_ranks(model_path) if protected is None else protected
    h, kv, inter, layers, vocab = _layer_dims(load_config(model_path))
    trainable = total_params
    frozen = v_basis = rebuilt = grams = 0
    for name, shape in shapes.items():
        experts, (n, m) = (shape[0] if len(shape) == 3 else 1), shape[-2:]
        p_left, p_right = protected.get(name, (0, 0))
        plan = plan_module(n, m, urr, tokens_per_gpu, p_left, p_right, experts=experts if len(shape) == 3 else 0)
        low = plan.k_low * (n + m + 1)
        u_basis = n * (plan.k_low if plan.u_keep else p_left + plan.k_high)
        v_rows = plan.k_low if plan.v_keep else p_right + plan.k_high
        trainable += experts * (low - n * m)
        frozen += experts * (n * m + u_basis + v_rows * m + n * p_left + m * p_right + low)
        v_basis += experts * v_rows * m
        rebuilt += experts * n * m if plan.forward_form in ("dense", "hybrid") else 0
        if protect_basis != "update" and len(shape) == 2 and gram_bytes(m) <= input_memory_gb * 1e9:
            grams += gram_bytes(m)
    block = max(_block_params(model), 1)
    per_token = 7 * h + 2 * kv + 4 * inter
    if activation_checkpointing:
        activations = (layers * h + per_token) * tokens_per_gpu * b + rebuilt * b // max(layers, 1)
    else:
        activations = layers * per_token * tokens_per_gpu * b + rebuilt * b
    cache = (device == "cpu") if cache_v is None else cache_v
    saved = _BYTES[save_dtype] * total_params
    return MemoryPlan(trainable=4 * trainable // w, frozen=4 * frozen // w, gradients=4 * trainable // w,
                      adamw=8 * trainable // w, gathered=2 * block * b if w > 1 else 0,
                      v_cache=4 * v_basis if (w > 1 and cache and osft) else 0, activations=activations,
                      logits=2 * 4 * tokens_per_gpu * vocab, runtime=CPU_RUNTIME_BYTES if device == "cpu" else 0,
                      loaded=4 * total_params if (w > 1 and device == "cpu") else 0,
                      export_state=4 * (trainable + frozen) if w > 1 else 0,
                      input_grams=min(grams, int(input_memory_gb * 1e9)),
                      export_weights=4 * total_params + saved if osft else saved)


def _block_params(model) -> int:
    """Parameters of the largest decoder layer (the unit FSDP2 shards and gathers)."""
    from torch import nn

    blocks = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max((sum(p.numel() for p in layer.parameters()) for ml in blocks for layer in ml), default=0)


def protected_ranks(model_path: str) -> dict[str, tuple[int, int]]:
    """(p_L, p_R) per module from the model directory's ``osft_subspaces.json`` ({} without one)."""
    path = Path(model_path) / "osft_subspaces.json"
    if not path.is_file():
        return {}
    modules = json.loads(path.read_text()).get("modules", {})
    return {name: (int(m["p_left"]), int(m["p_right"])) for name, m in modules.items()}


def render(plan: MemoryPlan, device_bytes: float | None) -> list[str]:
    """The table (GiB per part) and the verdict line."""
    rows = [f"  {name:<14} {value / 2**30:9.3f} GiB" for name, value in asdict(plan).items()]
    phases = [f"  {'training':<14} {plan.training / 2**30:9.3f} GiB", f"  {'export':<14} {plan.export / 2**30:9.3f} GiB"]
    return ["memory per rank:", *rows, *phases, plan.verdict(device_bytes)]


#: Training settings the estimate depends on; their flags come from :mod:`..config`'s declarations.
_RUN_SETTINGS = ("osft", "osft_unfreeze_rank_ratio", "max_tokens_per_gpu", "activation_checkpointing",
                 "osft_cache_v_high", "osft_protect_basis", "osft_protect_input_memory_gb", "save_dtype")


def main(argv: list[str], console) -> None:
    """``osft-train estimate-memory MODEL [...]``; prints the table and the verdict (``--json``: the plan)."""
    import argparse

    from ..config import FIELDS
    from ..setting import add_flag

    p = argparse.ArgumentParser(prog="osft-train estimate-memory", description=__doc__.splitlines()[0])
    p.add_argument("model", help="a model directory (its config.json) or an osft export")
    p.add_argument("--protected-rank", type=int, default=None, metavar="P",
                   help="p_L = p_R = P for every target (default: the model's osft_subspaces.json, else 0)")
    p.add_argument("--dtype", choices=tuple(_BYTES), default=None, help="compute dtype (default: by --device)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="where the ranks train")
    p.add_argument("--world-size", type=int, default=1, help="ranks the model is sharded over (FSDP2)")
    p.add_argument("--device-memory-gb", type=float, default=None, help="memory of one device, GB (10^9 bytes)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    g = p.add_argument_group("training settings (as osft-train's, same defaults)")
    for field in FIELDS:
        if field.name in _RUN_SETTINGS:
            add_flag(g, field, require_paths=False)
    args = p.parse_args(argv)
    protected = None
    if args.protected_rank is not None:
        from ..model.build import target_shapes

        protected = {name: (args.protected_rank, args.protected_rank) for name in target_shapes(args.model, None)}
    plan = estimate(args.model, osft=args.osft, urr=args.osft_unfreeze_rank_ratio, protected=protected,
                    dtype=args.dtype or ("float32" if args.device == "cpu" else "bfloat16"), world_size=args.world_size,
                    tokens_per_gpu=args.max_tokens_per_gpu, activation_checkpointing=args.activation_checkpointing,
                    cache_v=args.osft_cache_v_high, device=args.device, protect_basis=args.osft_protect_basis,
                    input_memory_gb=args.osft_protect_input_memory_gb, save_dtype=args.save_dtype)
    device_bytes = args.device_memory_gb * 1e9 if args.device_memory_gb else None
    if args.json:
        console.print_json(json.dumps({**asdict(plan), "training": plan.training, "export": plan.export,
                                       "total": plan.total, "verdict": plan.verdict(device_bytes)}))
        return
    for line in render(plan, device_bytes):
        console.print(line, markup=False, highlight=False)
