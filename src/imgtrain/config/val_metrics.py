"""What validation computes: the one list, `VAL_METRICS`, that metrics.json's fields, the TensorBoard tags, the
console table, `optimized_metric`'s choices and docs/measurements.md's rows all follow (tests/test_docs.py checks the
docs against it). A metric of your own: an entry here and its sum per batch in `batch_sums`; nothing else changes.

It lives with the config (and imports nothing of imgtrain) so the schema can offer its fields as `optimized_metric`
choices; the loop, the metrics and the checkpointer read it from here. `fields` → `val_metrics` → `schema`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ValMetric:
    """One figure validation computes over the whole validation set, each image counted once across ranks."""

    key: str  # metrics.json: val_<key> (val_<key>_ema for the EMA); TensorBoard: val/<key> (val_ema/<key>)
    about: str  # what it is: docs/measurements.md's row for val_<key> says this
    label: str  # the console table's row
    top_k: int | None = None  # top-k accuracy (k capped at the number of classes); None: the mean cross-entropy


VAL_METRICS = (
    ValMetric("acc", "top-1 accuracy on the validation set", "val acc (top-1)", top_k=1),
    ValMetric(
        "acc5",
        "top-5 accuracy on the validation set (top-k with k capped at the number of classes)",
        "val acc (top-5)",
        top_k=5,
    ),
    # Plain cross-entropy whatever `loss` trains with (focal, label smoothing, mixup), so runs compare.
    ValMetric("loss", "mean cross-entropy on the validation set, whatever `loss` trains with", "val loss"),
)
BEST = VAL_METRICS[0]  # best.pt and best_val_acc follow it: the higher the better
EMA = "_ema"  # the suffix of the EMA's figures (train.ema_decay); TensorBoard's val_ema/ section


def field(metric: ValMetric, ema: bool = False) -> str:
    """Its metrics.json field (and key of `evaluate`'s figures): val_acc, val_acc_ema, ..."""
    return f"val_{metric.key}{EMA if ema else ''}"


def tag(metric: ValMetric, ema: bool = False) -> str:
    """Its TensorBoard tag: val/acc, val_ema/acc, ..."""
    return f"val{EMA if ema else ''}/{metric.key}"


def best_field(ema: bool = False) -> str:
    """The best epoch's figure of `BEST`: best_val_acc, best_val_acc_ema."""
    return f"best_{field(BEST, ema)}"


def summary_fields() -> tuple[str, ...]:
    """metrics.json's validation fields, in the file's order (RunSummary places them)."""
    model = tuple(field(metric) for metric in VAL_METRICS)
    ema = tuple(field(metric, ema=True) for metric in VAL_METRICS)
    return (*model, *ema, "val_count", best_field(), best_field(ema=True))


def objectives() -> tuple[str, ...]:
    """The validation fields a sweep may optimise (`optimized_metric`)."""
    return tuple(name for name in summary_fields() if name != "val_count")


def summary_docs() -> dict[str, str]:
    """What docs/measurements.md's row of each validation field must say (tests/test_docs.py checks it)."""
    said = {field(metric): metric.about for metric in VAL_METRICS}
    said |= {field(metric, ema=True): f"as `{field(metric)}`, for the weights' EMA" for metric in VAL_METRICS}
    best = {best_field(ema): f"the best epoch's `{field(BEST, ema)}`" for ema in (False, True)}
    return {**said, "val_count": "validation images counted", **best}


def batch_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each entry's sum over a batch, in `VAL_METRICS`' order, on the device (no sync): its correct top-k predictions,
    or its summed cross-entropy. One `topk` for the largest k; float64, so sums over many batches stay exact."""
    logits = logits.float()
    largest = min(max(metric.top_k or 1 for metric in VAL_METRICS), logits.shape[1])
    hits = logits.topk(largest, dim=1).indices == labels[:, None]  # [B, largest]: at most one True per row
    sums = [
        F.cross_entropy(logits, labels, reduction="sum")
        if metric.top_k is None
        else hits[:, : min(metric.top_k, largest)].sum()
        for metric in VAL_METRICS
    ]
    return torch.stack([value.double() for value in sums])
