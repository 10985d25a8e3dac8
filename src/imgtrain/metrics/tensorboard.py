"""TensorBoard scalars and the HParams tab, rank 0 only (the other ranks get a logger that does nothing)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from imgtrain.config.val_metrics import VAL_METRICS, field


def _hparam_value(value: Any) -> bool | int | float | str:
    """Convert a value to a type the TensorBoard HParams plugin accepts."""
    if value is None:
        return "null"
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):  # also numpy ints
        return int(value)
    if isinstance(value, numbers.Real):  # also numpy floats
        return float(value)
    return str(list(value)) if isinstance(value, (list, tuple)) else str(value)


def flatten_hparams(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """Flatten nested mappings with "." joined keys and convert values for the HParams plugin."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in hparams.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_hparams(value, f"{name}."))
        else:
            flat[name] = _hparam_value(value)
    return flat


def hparams(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Loader settings (and what else defines the run) for TensorBoard's HParams tab."""
    params = {f"data/{k}": v for k, v in summary["loader"].items()}
    params.update({key: summary[key] for key in ("dataset", "model", "precision", "device", "world_size")})
    return params


def hparam_metrics(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """The final figures the HParams tab shows next to each run's settings: speed, resources and what validation
    computes (config/val_metrics.py)."""
    validation = tuple(field(metric) for metric in VAL_METRICS)
    keys = ("images_per_sec", "data_wait_frac", "gpu_util_mean", *validation, "rss_peak_gb", "pss_peak_gb")
    return {f"hparam/{k}": summary.get(k) for k in keys}


class MetricsLogger:
    """TensorBoard logger; with enabled=False (non-zero ranks) it is a no-op that creates nothing."""

    def __init__(self, log_dir: str | None, enabled: bool = True, purge_step: int | None = None) -> None:
        self.enabled = enabled and log_dir is not None
        self.log_dir = log_dir
        self._writer: Any = None
        if self.enabled:
            # Imported lazily so disabled ranks never pay for (or depend on) tensorboard.
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events an earlier, interrupted writer logged at steps >= purge_step are hidden.
            self._writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def log(self, metrics: Mapping[str, float | int | None], step: int) -> None:
        """Write one scalar per key at `step`; None values are skipped."""
        if self._writer is None:
            return
        for key, value in metrics.items():
            if value is not None:
                self._writer.add_scalar(key, float(value), global_step=step)

    def log_hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float | None]) -> None:
        """Write HParams plugin data plus final metric values into the run directory itself."""
        if self._writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        # Unlike SummaryWriter.add_hparams (which opens a timestamped sub-run), write into this run so
        # the HParams tab lines up with the scalars. Metric names should not clash with per-step tags.
        # Every metric name is declared (consistent columns across runs); only non-None values are written.
        experiment, start_info, end_info = hparams_summaries(flatten_hparams(hparams), dict(metrics))
        file_writer = self._writer.file_writer
        for summary in (experiment, start_info, end_info):
            file_writer.add_summary(summary)
        for key, value in metrics.items():
            if value is not None:
                self._writer.add_scalar(key, float(value))
        self._writer.flush()

    def flush(self) -> None:
        """Flush pending events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the writer; idempotent."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
