"""The machine a run is on: the CPUs it may use, the process group torchrun describes, the optional engines
installed."""
