"""Dynamic load balancing: measured per-rank compute -> new block sizes.

``Balancer`` (balancer.py) measures, agrees and moves the data's layout;
``sizes`` is its arithmetic (throughputs -> sizes, numpy only). See
docs/balance.md for when to use it.
"""
from .balancer import Balancer
from .sizes import (
    affine_fit,
    affine_plan,
    affine_times,
    balanced_plan,
    damped,
    gain,
    predicted_time,
    proportional_sizes,
)

__all__ = ["Balancer", "affine_fit", "affine_plan", "affine_times", "balanced_plan", "damped", "gain",
           "predicted_time", "proportional_sizes"]
