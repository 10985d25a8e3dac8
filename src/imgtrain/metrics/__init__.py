"""Every number a run reports, through one component (`Metrics`, in `processor`): step windows (`windows`),
GPU/CPU/memory sampling (`monitor`), TensorBoard (`tensorboard`), and what the console shows (`report`). `Metrics`
and `profiling.Profiler` are instruments of the loop: they define hooks of train/instruments.py's `Instrument`."""

from imgtrain.metrics.processor import Metrics

__all__ = ["Metrics"]
