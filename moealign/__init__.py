"""moealign: make MoE RL runs on-policy at the systems level."""

__version__ = "0.1.0"
