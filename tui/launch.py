"""Starting runs from the dashboard: the new-run form's values, the ``osft-train`` command lines,
and launchers started in process sessions of their own (so they outlive the dashboard).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from osft.trainer.contract import JOB_ID_ENV
from osft.trainer.tools.demo_assets import DATA_DIRNAME, MODEL_DIRNAME, default_demo_dir
from osft.trainer.rundir import RunDir

#: How the dashboard runs the launcher: this interpreter's ``osft-train``.
DEFAULT_LAUNCHER = [sys.executable, "-m", "osft.trainer.launch.cli"]
#: Flags that choose what to resume from; a relaunch replaces them.
RESUME_FLAGS = ("--resume", "--resume-from-full-state-checkpoint")
#: The flag that lets a new run start over in a directory an earlier run left outputs in.
OVERWRITE_FLAG = "--overwrite-output-dir"


@dataclass
class RunSpec:
    """The new-run form.

    Attributes:
        nnodes: nodes; node 1.. are simulated on this machine (one launcher per node, c10d
            rendezvous on 127.0.0.1).
        nproc_per_node: ranks per node.
        urr: ``--osft-unfreeze-rank-ratio`` (0 < URR ≤ 1).
        learning_rate: peak learning rate.
        extra_args: more ``osft-train`` flags, shell-quoted (e.g. ``--batch-size 8 --lr-scheduler cosine``).
    """

    model: str
    data: str
    output_dir: str
    nnodes: int = 1
    nproc_per_node: int = 2
    urr: float = 0.25
    learning_rate: float = 5e-5
    max_steps: int = 30
    extra_args: str = ""

    @classmethod
    def demo(cls) -> RunSpec:
        """The demo job: SmolLM2-135M-Instruct on chit-chat (``osft-train fetch-demo``), 2 CPU ranks."""
        root = default_demo_dir()
        return cls(model=str(root / MODEL_DIRNAME), data=str(root / DATA_DIRNAME / "train.jsonl"),
                   output_dir="runs/tui-demo")

    @property
    def is_demo(self) -> bool:
        """Whether model and data are the demo's (then ``osft-train demo`` fetches them if needed
        and supplies its CPU-sized batch settings)."""
        demo = RunSpec.demo()
        return (Path(self.model), Path(self.data)) == (Path(demo.model), Path(demo.data))

    def has_flag(self, *flags: str) -> bool:
        """Whether the extra flags hold one of ``flags`` (alone or as ``--flag=value``)."""
        return any(arg.split("=", 1)[0] in flags for arg in shlex.split(self.extra_args))

    def with_flag(self, flag: str) -> RunSpec:
        """This spec with ``flag`` added to its extra flags."""
        return replace(self, extra_args=f"{self.extra_args} {flag}".strip())

    def check(self) -> list[str]:
        """Problems with the form's values, each naming its field (empty when it can launch)."""
        problems = []
        if not self.is_demo:
            if not Path(self.model).exists() and not self.model.endswith(".gguf"):
                problems.append(f"model: {self.model} does not exist")
            if not Path(self.data).is_file():
                problems.append(f"data: {self.data} is not a file")
        if not self.output_dir.strip():
            problems.append("output dir: empty")
        if self.nnodes < 1 or self.nproc_per_node < 1 or self.max_steps < 1:
            problems.append("nodes, processes per node and max steps must be at least 1")
        if not 0 < self.urr <= 1:
            problems.append(f"URR: {self.urr} is not in (0, 1]")
        if not self.learning_rate > 0:
            problems.append(f"learning rate: {self.learning_rate} is not positive")
        try:
            shlex.split(self.extra_args)
        except ValueError as exc:
            problems.append(f"extra flags: {exc}")
        return problems

    def node_argvs(self) -> list[list[str]]:
        """``osft-train`` arguments (without the program) for each node, node 0 first."""
        head = ["demo"] if self.is_demo else ["--model-name-or-path", self.model, "--data-path", self.data]
        common = head + [
            "--output-dir", self.output_dir, "--nproc-per-node", str(self.nproc_per_node),
            "--osft-unfreeze-rank-ratio", str(self.urr), "--learning-rate", str(self.learning_rate),
            "--max-steps", str(self.max_steps), "--on-demand-checkpointing", *shlex.split(self.extra_args),
        ]
        if self.nnodes == 1:
            return [common]
        endpoint = f"127.0.0.1:{free_port()}"
        return [common + ["--nnodes", str(self.nnodes), "--node-rank", str(n), "--rdzv-endpoint", endpoint]
                for n in range(self.nnodes)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the c10d rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resume_argv(argv: list[str], checkpoint: Path) -> list[str]:
    """``argv`` (a run's ``osft-train`` arguments, without the program) with its resume flags
    replaced by ``--resume-from-full-state-checkpoint <checkpoint>``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--resume-from-full-state-checkpoint":
            skip = True
            continue
        if arg in RESUME_FLAGS or arg.startswith("--resume-from-full-state-checkpoint="):
            continue
        out.append(arg)
    return out + ["--resume-from-full-state-checkpoint", str(checkpoint)]


def node_of(argv: list[str]) -> int:
    """The ``--node-rank`` in ``argv`` (0 when absent)."""
    for i, arg in enumerate(argv):
        if arg == "--node-rank" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--node-rank="):
            return int(arg.split("=", 1)[1])
    return 0


def start(launcher: list[str], argv: list[str], output_dir: str | Path) -> subprocess.Popen:
    """Start one launcher (``launcher + argv``) in a process session of its own, with its output
    appended to ``logs/launcher.node<N>.log`` (:meth:`RunDir.launcher_log`): it keeps running when the dashboard exits or is killed.

    Raises:
        OSError: the program cannot be started or the log cannot be written.
    """
    log = RunDir(output_dir).launcher_log(node_of(argv))
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"$ {shlex.join(launcher + argv)}\n".encode())
        out.flush()
        env = dict(os.environ)
        env.pop(JOB_ID_ENV, None)  # a job id of the dashboard's environment must not leak into a new job
        return subprocess.Popen(launcher + argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
