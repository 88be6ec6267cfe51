"""The accuracy matrix of a task sequence and the continual-learning measures derived from it.

R has T + 1 rows and T columns: R[0][j] is the base model's score on task j, R[i][j] the score on
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


def sequence_measures(R: np.ndarray) -> dict[str, np.ndarray]:
    """AA, LA, BWT, FWT and F of accuracy matrices ``R`` (shape [..., T + 1, T], T ≥ 2).

    Returns:
        measure name -> array of the leading shape (a float for a single matrix's 0-d array).

    Raises:
        ValueError: R is not [..., T + 1, T] with T ≥ 2.
    """
    R = np.asarray(R, dtype=np.float64)
    if R.ndim < 2 or R.shape[-2] != R.shape[-1] + 1 or R.shape[-1] < 2:
        raise ValueError(f"accuracy matrix must be [..., T + 1, T] with T >= 2, got shape {R.shape}")
    T = R.shape[-1]
    tasks = np.arange(T)
    learned = R[..., tasks + 1, tasks]  # R[j + 1][j]
    final = R[..., T, :]
    before = R[..., tasks[1:], tasks[1:]]  # R[j][j], j >= 1
    best = np.stack([R[..., j + 1 : T, j].max(axis=-1) for j in range(T - 1)], axis=-1)
    return {"AA": final.mean(-1), "LA": learned.mean(-1), "BWT": (final[..., :-1] - learned[..., :-1]).mean(-1),
            "FWT": (before - R[..., 0, 1:]).mean(-1), "F": (best - final[..., :-1]).mean(-1)}
