"""Studies built on the engine: benchmarks of several methods, sweeps, the privacy audit and
the README's numbers."""
