"""The input pipeline: datasets (`datasets`, `shapes`, `jpeg`) and the CPU decoder (`decoders`), DataLoader plans
and samplers (`loader`), feeding the device (`feed`: prefetch, GPU decode, device-resident data), and the run's
loaders (`pipeline`; `streamed` for the splits an optional engine streams, `shards/`)."""
