"""adaLN modulation: ``x * (1 + scale) + shift``, gating, and timestep conditioning."""
