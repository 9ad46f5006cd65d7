"""fedsgld: differentially private Langevin dynamics (DP-SGLD) across hospital sites."""

__version__ = "0.1.0"
