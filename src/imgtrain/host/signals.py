"""The signals that stop a run: the resilience layer turns them into a checkpoint and a clean exit, and the loader's
workers leave them to the main process."""

from __future__ import annotations

import signal

# Signals that ask for a checkpoint and a clean exit: SIGTERM (SLURM preemption and scancel, torchrun's
# agent, `kill`), SIGUSR1 (sbatch --signal=USR1@120), SIGINT (Ctrl-C: the terminal sends it to the whole
# foreground process group, workers included), and submitit's own requeue signal when it set one up.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
SUBMITIT_SIGNAL = signal.SIGUSR2
