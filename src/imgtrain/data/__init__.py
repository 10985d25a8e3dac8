"""The input pipeline: datasets (`datasets`, `shapes`, `jpeg`), DataLoader plans and samplers (`loader`),
feeding the device (`feed`: prefetch, GPU decode, device-resident data), and the run's loaders (`pipeline`)."""
