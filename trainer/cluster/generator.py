"""What the cluster generators (``osft-train slurm-script``, ``osft-train k8s-manifest``) share: the
flags every node's command gets, and the check of the training flags a job is generated for.

A generated job runs the same ``osft-train`` command on every node with ``--nnodes``,
``--node-rank``, ``--nproc-per-node`` and ``--rdzv-endpoint`` set by the scheduler's environment,
and always with ``--on-demand-checkpointing --resume``: the scheduler's stop signal becomes a
checkpoint and exit code 75, and the restarted job continues from the newest complete checkpoint
(a no-op on the first start).
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass

from ..config import TrainConfig, build_parser, config_from_args, non_negative_int, positive_int
from ..config_file import ConfigFileError, parse_with_config_file

#: Seconds added to ``--checkpoint-grace-seconds`` for the scheduler's warning time (SLURM
#: ``--signal``) or kill delay (Kubernetes ``terminationGracePeriodSeconds``): the ranks get the
#: whole grace period, and the launcher's own shutdown (and a requeue) fits before the hard kill.
GRACE_MARGIN_S = 60

#: Training flags the generated job sets itself, per node (``dest`` -> flag).
NODE_FLAGS = {
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "rdzv_endpoint": "--rdzv-endpoint",
    "resume_from_full_state_checkpoint": "--resume-from-full-state-checkpoint",
}

#: Flags every generated job adds; a copy among the training flags is dropped.
ADDED_FLAGS = ("--on-demand-checkpointing", "--resume")

#: Caches a generated job puts on the run volume, under ``<output_dir>/cache/``: the node's home
#: and install directory may be read-only (a container with ``readOnlyRootFilesystem``, OpenShift's
#: ``HOME=/``). Variable -> subdirectory.
CACHE_ENV = {
    "OSFT_DATA_CACHE": "tokenized",  # the tokenized-data cache (--data-cache-dir overrides it)
    "NUMBA_CACHE_DIR": "numba",
    "HF_HOME": "huggingface",
    "HF_DATASETS_CACHE": "datasets",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "MPLCONFIGDIR": "matplotlib",
    "XDG_CACHE_HOME": "xdg",
}


def cache_env(output_dir: str) -> dict[str, str]:
    """The :data:`CACHE_ENV` variables of a job whose run directory is ``output_dir``."""
    return {name: f"{output_dir}/cache/{sub}" for name, sub in CACHE_ENV.items()}


#: Control characters (line breaks included), refused in every value a generated job embeds.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_printable(values: list[str]) -> None:
    """Refuse control characters in the values a generated job embeds: a line break in a value
    would end the comment or directive line it is written into, and what follows would run.

    Raises:
        ValueError: naming the first value that holds one.
    """
    for value in values:
        if _CONTROL.search(value):
            raise ValueError(f"{value!r} contains a control character (a line break, a tab, ...), which a generated "
                             "job cannot carry")


@dataclass(frozen=True)
class TrainJob:
    """The training part of a generated job.

    Attributes:
        argv: the training flags as given, without :data:`ADDED_FLAGS`.
        config: those flags parsed, with ``nproc_per_node`` resolved (see :func:`parse_train_flags`).
        launcher: the command that starts training on a node, split into words (``osft-train``).
    """

    argv: list[str]
    config: TrainConfig
    launcher: list[str]

    def node_flags(self, nnodes: str, rdzv_endpoint: str, node_rank: str | None = None) -> list[str]:
        """The flags each node adds to :attr:`argv`, with the given values (which may be shell or
        Kubernetes variable references); ``--node-rank`` only when ``node_rank`` is given."""
        rank = ["--node-rank", node_rank] if node_rank is not None else []
        return ["--nnodes", nnodes, *rank, "--nproc-per-node", str(self.config.nproc_per_node),
                "--rdzv-endpoint", rdzv_endpoint, *ADDED_FLAGS]


def cluster_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser of a generator's own flags (no abbreviations, so no training flag is taken for
    one of them); the flags both generators have are already added."""
    p = argparse.ArgumentParser(prog=f"{prog} [training flags]", description=description, allow_abbrev=False,
                                epilog="Every other flag is a training flag (see osft-train --help); "
                                       "--model-name-or-path, --data-path and --output-dir are required.")
    p.add_argument("--nodes", type=positive_int, required=True, help="number of nodes (>= 1)")
    p.add_argument("--gpus-per-node", type=non_negative_int, required=True,
                   help="GPUs per node (>= 0); one rank per GPU unless --nproc-per-node says otherwise, "
                        "one rank on a node without GPUs")
    p.add_argument("--job-name", default="osft", help="name of the job (default: osft)")
    p.add_argument("--launcher", default="osft-train",
                   help="command that runs osft-train on a node, e.g. a container wrapper (default: osft-train)")
    return p


def parse_train_flags(prog: str, train_argv: list[str], gpus_per_node: int, launcher: str) -> TrainJob:
    """Check the training flags of a generated job and resolve its ranks per node: the
    ``--nproc-per-node`` given, else ``gpus_per_node``, else 1.

    Input paths are not checked here (the job may see other paths than this machine); a
    ``--config FILE`` is read here and again by each node.

    Raises:
        SystemExit: exit code 2, after argparse printed the usage and the error: a bad training
            flag or config file, a missing required flag, or one of :data:`NODE_FLAGS`, which the
            job sets itself.
    """
    parser = build_parser(f"{prog} [training flags]")
    parser.set_defaults(nproc_per_node=None)
    try:
        args = parse_with_config_file(parser, train_argv)
    except ConfigFileError as exc:
        parser.error(str(exc))
    defaults = TrainConfig("", "", "")
    for dest, flag in NODE_FLAGS.items():
        if getattr(args, dest) != getattr(defaults, dest):
            parser.error(f"{flag} is set by the generated job on each node; leave it out")
    if args.nproc_per_node is None:
        args.nproc_per_node = gpus_per_node or 1
    words = shlex.split(launcher)
    if not words:
        parser.error("--launcher is empty")
    return TrainJob([a for a in train_argv if a not in ADDED_FLAGS], config_from_args(args), words)
