"""DataLoader failures, explained: one line saying the likely cause and the setting to change."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psutil

from imgtrain.common.errors import RunError
from imgtrain.config.data import DataConfig

T = TypeVar("T")

# Seconds a killed worker is waited for: SIGKILL ends it at once, unless the kernel holds it in an uninterruptible read
KILL_WAIT_S = 2.0


class LoaderFailed(RunError):
    """A DataLoader failure explained in one line (a dead worker, full shared memory, a timeout). It happens
    between steps, so the weights are those of the last completed step: the loop can save them before it stops."""


class LoaderTimedOut(LoaderFailed):
    """data.timeout passed without a batch: a worker is stuck, and is stopped without waiting for it."""


def next_batch(batches: Any, data: DataConfig) -> Any:
    """The next batch, or None at the end of the epoch; DataLoader failures become one line saying what to change."""
    with explained(lambda: batches, data):
        return next(batches, None)


def first_batches(loader: Any, data: DataConfig) -> Any:
    """`iter(loader)`: an epoch's iterator. With persistent workers it waits for each worker to acknowledge the
    new epoch, so a worker that died since the last epoch is found here, explained the same way."""
    with explained(lambda: getattr(loader, "_iterator", None), data):
        return iter(loader)


@contextlib.contextmanager
def explained(iterator: Callable[[], Any], data: DataConfig) -> Iterator[None]:
    """DataLoader errors as one line: ours raised in a worker without the traceback it came wrapped in, PyTorch's
    with the likely cause and the setting to change (`iterator()` says how its workers died)."""
    try:
        yield
    except RunError as error:  # one of ours from a worker (a shard that cannot be read) comes wrapped in its traceback
        raise type(error)(worker_message(str(error))) from None
    except RuntimeError as error:
        explanation = explain_loader_failure(_with_exit_signals(str(error), iterator()), data)
        if explanation is None:
            raise
        timed_out = "DataLoader timed out after" in str(error)  # PyTorch's words for data.timeout
        raise (LoaderTimedOut if timed_out else LoaderFailed)(explanation) from error


def worker_message(message: str) -> str:
    """The error's own message, without the traceback a DataLoader worker wraps it in ("Caught X in DataLoader
    worker process N. Original Traceback ... module.X: message")."""
    if not message.startswith("Caught "):
        return message
    last = message.strip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


@contextlib.contextmanager
def workers_stopped_on_error(batches: Any) -> Iterator[Any]:
    """Yield a DataLoader iterator; if the loop ends early (error or stop signal), stop its workers politely now.

    Otherwise they would be stopped at interpreter exit with SIGTERM, which workers deliberately outlive for
    WORKER_GRACE_S (see worker_signals).
    """
    try:
        yield batches
    except BaseException as error:
        stop_workers(batches, stuck=isinstance(error, LoaderTimedOut))
        raise


def stop_workers(iterator: Any, stuck: bool = False) -> None:
    """Stop a DataLoader iterator's workers now, politely, with PyTorch's own (private, long-stable) shutdown
    method; persistent workers too. Anything without workers (None, a plain iterator) is left alone.

    `stuck` (data.timeout passed): the workers holding a batch not yet received are killed first. One stuck in a read
    cannot answer, and it outlives the SIGTERM PyTorch's shutdown sends by WORKER_GRACE_S (loader.worker_signals,
    for a job-wide stop): the shutdown would wait 10 s for it, and the process's exit up to 30 s more."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if not callable(shutdown):
        return
    for worker in _holding_batches(iterator) if stuck else ():
        worker.kill()
        worker.join(timeout=KILL_WAIT_S)
    shutdown()


def _holding_batches(iterator: Any) -> list[Any]:
    """The live workers of a DataLoader iterator that were sent a batch not yet received (PyTorch's private task
    bookkeeping, read defensively: nothing found, nothing killed; the polite shutdown then does it all)."""
    workers, tasks = getattr(iterator, "_workers", []), getattr(iterator, "_task_info", {})
    holding = {info[0] for info in tasks.values() if isinstance(info, tuple) and len(info) == 1}  # (worker_id,)
    return [workers[i] for i in sorted(holding) if isinstance(i, int) and i < len(workers) and workers[i].is_alive()]


@contextlib.contextmanager
def worker_deaths_found_at_next_batch(start: Callable[[], T] = lambda: None) -> Iterator[T]:
    """During an epoch, a dead worker is found by the next batch request (PyTorch checks its workers every 5 s
    while it waits: "exited unexpectedly") rather than by PyTorch's SIGCHLD handler, which raises wherever the
    main thread is: in backward() or half-way through an optimizer step, with a traceback and weights that
    cannot be saved. (Workers started by forkserver are not our children: their SIGCHLD never comes here.)

    `start()` starts the workers (an epoch's iterator), inside: PyTorch sets its handler when a process's first
    workers start, and it is turned off again, so that leaving restores SIGCHLD as it was before them. Around the
    whole of training (`loop.fit`), it keeps it off between epochs too, during validation and the checkpoint's
    save: a persistent worker that dies then is found as the next epoch starts (`first_batches`)."""
    if threading.current_thread() is not threading.main_thread():
        yield start()
        return
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        started = start()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        yield started
    finally:
        signal.signal(signal.SIGCHLD, previous)


def _with_exit_signals(message: str, batches: Any) -> str:
    """Add how dead workers died: PyTorch's "exited unexpectedly" path does not say (a private attribute)."""
    if "exited unexpectedly" not in message:
        return message
    while hasattr(batches, "inner"):  # the DataLoader iterator behind a BatchesAhead, joined slices (data/slices.py)
        batches = batches.inner
    codes = [w.exitcode for w in getattr(batches, "_workers", []) if w.exitcode is not None and w.exitcode < 0]
    names = sorted({signal.Signals(-code).name for code in codes if -code in signal.Signals._value2member_map_})
    readable = {"SIGBUS": "Bus error", "SIGKILL": "Killed", "SIGSEGV": "Segmentation fault"}
    shown = ", ".join(readable.get(name, name) for name in names)
    return message.strip().splitlines()[0].rstrip(".") + f" (killed by signal: {shown})" if shown else message


def _free_gb(path: str) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 1e9:.1f} GB free"
    except OSError:
        return "size unknown"


def explain_loader_failure(message: str, data: DataConfig) -> str | None:
    """The likely cause and the setting to change for a DataLoader error message; None if it is not one."""
    lines = message.strip().splitlines() or [message]
    # An exception raised in a worker arrives as "Caught X in DataLoader worker process N." and its traceback:
    # the last line says what happened (torch's "unable to allocate shared memory(shm) ...: No space left").
    first = lines[-1] if lines[0].startswith("Caught ") else lines[0]
    fewer = "lower data.num_workers, data.prefetch_factor or data.batch_size"
    if "timed out after" in first:
        return (
            f"{first}: data.timeout={data.timeout:g} s passed without a batch, so a worker is stuck or very slow "
            "(hung network storage, a deadlock after fork, a very slow transform). Raise data.timeout, try "
            "data.multiprocessing_context=spawn, or run with data.num_workers=0 to see where it hangs"
        )
    if "Bus error" in first or "shared memory" in first or "No space left on device" in first:
        return (
            f"{first}: shared memory (/dev/shm, {_free_gb('/dev/shm')}) is too small for the batches in flight "
            f"(num_workers x prefetch_factor batches). {fewer}; in Docker, start the container with "
            "--shm-size=8g or --ipc=host"
        )
    if "signal: Killed" in first:
        available = psutil.virtual_memory().available / 1e9
        return (
            f"{first}: most likely the out-of-memory killer (host memory now {available:.1f} GB available, "
            f"/dev/shm {_free_gb('/dev/shm')}). "
            f"{fewer}, or set data.persistent_workers=false; `dmesg` shows OOM kills"
        )
    if "received 0 items of ancdata" in first or "Too many open files" in first:
        return (
            f"{first}: the process ran out of file descriptors passing tensors between processes. Raise the "
            "limit (`ulimit -n 65536`) or lower data.num_workers and data.prefetch_factor"
        )
    if re.search(r"DataLoader worker \(pid", first):
        return (
            f"{first}: a worker crashed, possibly in native decoding code or out of memory. Run with "
            "data.num_workers=0 to get the Python error, or lower data.num_workers and data.prefetch_factor"
        )
    return None
