"""Where this process sits in a job: rank, local rank, node rank and world size from the environment.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and GROUP_RANK (the node index under c10d rendezvous;
it sets no NODE_RANK). A plain ``python`` process is rank 0 of a world of 1.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    """Position of this process: global ``rank``, ``local_rank`` on its node, ``node_rank``,
    ``world_size`` (processes in the job) and ``hostname``."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    hostname: str

    @classmethod
    def from_env(cls) -> "DistEnv":
        """Read torchrun's variables (NODE_RANK is accepted when GROUP_RANK is absent)."""
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
            world_size=int(env.get("WORLD_SIZE", 1)),
            hostname=socket.gethostname(),
        )

    @property
    def is_local_main(self) -> bool:
        """True on each node's LOCAL_RANK 0: it prints progress and writes the node's metrics."""
        return self.local_rank == 0
