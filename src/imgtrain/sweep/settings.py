"""A sweep job's setting, as written (its overrides) and as it ran (metrics.json's `loader`: the DataLoader
arguments the run used). The two differ where the run overrode a setting it cannot honour: data.pin_memory=true
on a CPU runs unpinned (data/loader.py logs "has no effect on cpu: using false"), the worker-only arguments are
not passed without workers, num_workers=auto becomes a count. Jobs that ran alike differ only by noise, and the
report never recommends the dearer of them (sweep/rank.py)."""

from __future__ import annotations

from typing import Any

REPEAT_KEY = "repeat"  # a sweep dimension that runs the same setting again (config.Config.repeat)


def setting_of(row: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A job's setting: its overrides without the repeat index."""
    return tuple(sorted((k, str(v)) for k, v in row["overrides"].items() if k != REPEAT_KEY))


# The DataLoader arguments that a data.<key> override of the same name sets, as metrics.json's `loader` records
# them once the run has resolved them (data/loader.py): pin_memory off without CUDA, the worker-only arguments not
# passed without workers, auto and tune a count, distributed_sampler and augment_on what they came to, engine
# dataloader where threads had no workers to run (data.engine=threads with num_workers=0).
LOADER_ARGUMENTS = (
    "batch_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "in_order", "drop_last",
    "shuffle", "timeout", "multiprocessing_context", "distributed_sampler", "seed_workers", "device_resident",
    "prefetch_to_device", "augment_on", "engine",
)  # fmt: skip


def effective_setting(row: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A job's setting as it ran: each data.<key> of LOADER_ARGUMENTS as the run used it, the other overrides as
    written. Without a record of the loader (a failed job, an older metrics.json): as written."""
    loader = row.get("loader") or {}
    if "num_workers" not in loader:
        return setting_of(row)

    def ran(key: str, written: str) -> Any:
        name = key.removeprefix("data.")
        return ("ran with", loader.get(name)) if key.startswith("data.") and name in LOADER_ARGUMENTS else written

    return tuple((key, ran(key, value)) for key, value in setting_of(row))


def ran_alike(row: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two jobs of different settings ran with the same effective settings (data.pin_memory=true and
    false on a CPU): whatever separates their figures is the machine's noise, not the setting."""
    return (
        row is not other and setting_of(row) != setting_of(other) and effective_setting(row) == effective_setting(other)
    )


def no_effect(rows: list[dict[str, Any]]) -> list[str]:
    """The overrides whose written values differ between `rows` that ran alike: the keys that had no effect."""
    keys = dict.fromkeys(key for row in rows for key in row["overrides"] if key != REPEAT_KEY)
    return [key for key in keys if len({str(row["overrides"].get(key)) for row in rows}) > 1]


def written(row: dict[str, Any], key: str, effective: Any) -> Any:
    """data.<key> as the override wrote it (true/false, a count; auto or tune: None, not known), else as it ran."""
    value = row["overrides"].get(f"data.{key}")
    if value is None:
        return effective
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    return int(text) if text.isdigit() else None
