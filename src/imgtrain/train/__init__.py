"""What a fork edits first: the model, the training step (loss, optimiser, schedule, autocast), the loop and
`run(cfg)`, with the command line's error presentation (cli)."""
