"""imgtrain's Slurm launcher: Hydra's submitit launcher, each job's run directory locked before Hydra writes there,
and every end in one line (Hydra loads launchers from the hydra_plugins namespace only)."""
