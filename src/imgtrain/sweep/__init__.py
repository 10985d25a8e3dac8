"""After a multirun: the report's ranking of the jobs, its table and plot (a Hydra callback)."""
