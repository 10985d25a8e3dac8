"""How a run survives its end: stop signals and non-finite losses (faults), checkpoints, one writer per run
directory (rundir), what the ranks agree on, atomic writes, and the errors that end a run in one line."""
