"""Orthogonal Subspace Fine-Tuning (OSFT).

Nayak et al. 2025, "Sculpting Subspaces: Constrained Full Fine-Tuning in LLMs for Continual
Learning" (arXiv 2504.07097). Each targeted weight W (N×M) is split by SVD into a frozen high-rank
part (the directions of the k_high largest singular values: the model's prior knowledge) and a
trainable low-rank part; the trainable factors are kept orthogonal to the frozen subspaces.

Modules:
- :mod:`.targets`: which weights are decomposed (per-architecture name patterns).
- :mod:`.plan`: the run's OSFT settings, made once from the config, and the layout of one module
  under them (ranks, keep modes, forward form).
- :mod:`.decomposition`: SVD, rank split and the :class:`OSFTLinear` module that replaces a target.
- :mod:`.surgery`: every OSFT module is built there (one rank, several ranks, resume), and undone.
- :mod:`.projection`: gradient projection before and parameter re-projection after the optimizer step.
- :mod:`.orthogonality`: the violation measure (worst deviation from 90°).
- :mod:`.freeze`: ``--freeze-non-target`` (only the targets train) and trainable-parameter counts.
"""
