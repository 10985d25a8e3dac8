"""imgtrain's Hydra plugins (Hydra loads plugins from the hydra_plugins namespace only)."""
