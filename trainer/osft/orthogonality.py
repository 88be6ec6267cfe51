"""Orthogonality-violation measure between the frozen and trainable subspaces.

For every trainable singular vector x (a column of U_low, a row of V_low) the angle θ to the frozen
subspace satisfies cos θ = ‖P_high x‖ / ‖x‖, where P_high projects onto span(U_high) (or V_high).
OSFT wants θ = 90°; the deviation is 90° − θ = asin(‖P_high x‖/‖x‖), in degrees. A module's
deviation is the worst over all its trainable vectors on both sides; a module whose deviation
exceeds the margin (``--ortho-margin-deg``, default 1.0°) counts as one violation. The measurement
itself (distributed like the projection) is :meth:`.projection.Projector.check`.

Precision: in float32 a freshly projected vector measures about 1e-4° (a few ulps); bf16 factors
resolve only about 0.5° (8 significant bits), so keep the margin ≥ 1° for bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def fraction_to_degrees(fraction: float) -> float:
    """Deviation from 90° (degrees) of a vector whose frozen component is ``fraction`` of its norm."""
    return math.degrees(math.asin(min(1.0, max(0.0, fraction))))


@dataclass
class OrthoReport:
    """Result of one orthogonality check: ``violations`` = modules over the margin (count),
    ``max_dev_deg`` = worst deviation over all modules (degrees), ``violating`` = their names."""

    violations: int
    max_dev_deg: float
    violating: list[str] = field(default_factory=list)
