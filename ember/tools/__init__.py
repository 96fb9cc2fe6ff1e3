"""Users of the engine, not parts of it: benchmarks and the checkpoints they build."""
