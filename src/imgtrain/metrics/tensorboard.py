"""TensorBoard scalars and the HParams tab, rank 0 only (the other ranks get a logger that does nothing).

A write that fails (a full disk, above all) ends the run in one line naming the disk and its free space: TensorBoard
writes from a thread of its own, which prints its traceback and leaves the error for the next call to raise.
"""

from __future__ import annotations

import contextlib
import numbers
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from imgtrain.common.disk import disk_full_line, is_disk_full
from imgtrain.common.errors import RunError
from imgtrain.common.links import refuse_foreign_links
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


def _quiet_writer_threads(previous: Any) -> Any:
    """A threading.excepthook that stays silent for an OSError in TensorBoard's writer thread, which the next call
    of the writer raises again in the training thread (`MetricsLogger._writing`: one line), and hands every other
    thread's exception to `previous`."""

    def hook(args: threading.ExceptHookArgs) -> None:
        thread = type(args.thread).__module__ if args.thread is not None else ""
        if not (issubclass(args.exc_type, OSError) and thread.startswith("tensorboard.")):
            previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    return hook


class MetricsLogger:
    """TensorBoard logger; with enabled=False (non-zero ranks) it is a no-op that creates nothing."""

    def __init__(self, log_dir: str | None, enabled: bool = True, purge_step: int | None = None) -> None:
        self.enabled = enabled and log_dir is not None
        self.log_dir = log_dir
        self._writer: Any = None
        if self.enabled:
            # Imported lazily so disabled ranks never pay for (or depend on) tensorboard.
            from torch.utils.tensorboard import SummaryWriter

            folder = Path(log_dir)
            refuse_foreign_links(folder.parent, folder.name)  # tb/ a link another user planted: not written into
            if not getattr(threading.excepthook, "quiets_tensorboard", False):
                threading.excepthook = _quiet_writer_threads(threading.excepthook)
            with self._writing():
                # purge_step: events an earlier, interrupted writer logged at steps >= purge_step are hidden.
                self._writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A failed write (here, or earlier in the writer's thread) as one line: RunError."""
        try:
            yield
        except OSError as error:
            self._writer = None  # broken: nothing more is written, and closing it would raise again
            why = disk_full_line(self.log_dir, error) if is_disk_full(error) else error.strerror or str(error)
            raise RunError(f"TensorBoard could not write {self.log_dir}: {why}") from error

    def log(self, metrics: Mapping[str, float | int | None], step: int) -> None:
        """Write one scalar per key at `step`; None values are skipped."""
        if self._writer is None:
            return
        with self._writing():
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
        with self._writing():
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
            with self._writing():
                self._writer.flush()

    def close(self) -> None:
        """Flush and close the writer; idempotent."""
        if self._writer is not None:
            with self._writing():
                self._writer.flush()
                self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
