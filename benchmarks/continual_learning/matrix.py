"""The accuracy matrix of a task sequence and the continual-learning measures derived from it.

R has T + 1 rows and T columns (or a subset of the tasks, with the stage of each): R[0][j] is the base model's score on task j, R[i][j] the score on
task j after stage i (stage i trains task i − 1, tasks 0-based). Scores are "higher is better"
(exact match in points, or a negated NLL). With leading dimensions (bootstrap replicates: shape
[..., T + 1, T]) every measure is computed per replicate. The measures, for T ≥ 2:

- ``AA``, average accuracy after the last stage: mean_j R[T][j];
- ``LA``, learning accuracy: mean_j R[j + 1][j], each task right after it was learned
  (Riemer et al. 2019);
- ``BWT``, backward transfer: mean_{j < T−1} (R[T][j] − R[j + 1][j]), negative when earlier tasks
  are forgotten (Lopez-Paz & Ranzato 2017);
- ``FWT``, forward transfer: mean_{j ≥ 1} (R[j][j] − R[0][j]), what the earlier stages did for a
  task before it was trained (Lopez-Paz & Ranzato 2017);
- ``F``, forgetting: mean_{j < T−1} (max_{j+1 ≤ l ≤ T−1} R[l][j] − R[T][j]), the drop from the best
  score a task had before the last stage (Chaudhry et al. 2018).
"""

from __future__ import annotations

import numpy as np

MEASURES = ("AA", "LA", "BWT", "FWT", "F")


def sequence_measures(R: np.ndarray, stages: list[int] | None = None) -> dict[str, np.ndarray]:
    """AA, LA, BWT, FWT and F of accuracy matrices ``R`` (shape [..., T + 1, C]: T stages, C scored tasks).

    Args:
        stages: the stage (1..T) that trains each column's task; default column j at stage j + 1
            (C = T). A subset of the tasks (e.g. those scored in points) passes its own stages;
            BWT and F average over the columns trained before the last stage, FWT over those
            trained after the first.

    Returns:
        measure name -> array of the leading shape (NaN where no column qualifies).

    Raises:
        ValueError: R is not [..., T + 1, C], or a stage outside 1..T, or fewer than 2 stages.
    """
    R = np.asarray(R, dtype=np.float64)
    if R.ndim < 2 or R.shape[-2] < 3:
        raise ValueError(f"accuracy matrix must be [..., T + 1, T] with T >= 2, got shape {R.shape}")
    T = R.shape[-2] - 1
    stages = list(range(1, R.shape[-1] + 1)) if stages is None else list(stages)
    if len(stages) != R.shape[-1] or not all(1 <= s <= T for s in stages):
        raise ValueError(f"accuracy matrix must be [..., T + 1, T] with T >= 2 and stages in 1..T, got shape "
                         f"{R.shape} and stages {stages}")
    cols = np.arange(len(stages))
    s = np.asarray(stages)
    learned = R[..., s, cols]  # R[s_j][j]
    final = R[..., T, :]
    early, late = s < T, s > 1
    nan = np.full(R.shape[:-2], np.nan)

    def mean(x, mask):
        return x[..., mask].mean(-1) if mask.any() else nan

    best = np.stack([R[..., s[j]:T, j].max(axis=-1) for j in cols[early]], axis=-1) if early.any() else None
    return {"AA": final.mean(-1), "LA": learned.mean(-1), "BWT": mean(final - learned, early),
            "FWT": mean(R[..., s - 1, cols] - R[..., 0, :], late),
            "F": (best - final[..., early]).mean(-1) if best is not None else nan}
