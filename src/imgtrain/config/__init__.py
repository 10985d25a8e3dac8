"""The typed config schemas (dataclasses registered with Hydra's ConfigStore), their checks and choices."""
