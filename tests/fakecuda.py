"""CUDA streams and events that run on a machine without a GPU, to test what the GPU paths do with them.

`install(monkeypatch)` swaps torch.cuda's Stream, Event, stream(), current_stream() and Tensor.record_stream for
stand-ins that record every call. The code under test keeps its own logic (which stream waits for which, what
is recorded, what is synchronized); only the device work is absent. Tensors stay on the CPU, so the code's
device-bound calls (decode_jpeg on cuda, `.to("cuda")`) must be replaced by the test itself: `jpeg_batches` and
`decoding_on_the_cpu` do it for dataset.decode=cuda's decode stage.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from imgtrain.data.datasets import build_shapes
from imgtrain.data.gpu_decode import JpegBatchDecoder
from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.samples import Batch
from imgtrain.data.stages import BatchTimes


class FakeEvent:
    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self.at: float | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.at = time.perf_counter()
        (stream or FAKE.current()).calls.append("record")

    def query(self) -> bool:
        return self.at is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        """Milliseconds, as CUDA's: here the host time between the two records."""
        return (end.at - self.at) * 1000.0


class FakeStream:
    def __init__(self, device: object = None, name: str = "side") -> None:
        self.name, self.calls = name, []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        self.calls.append("wait_event")

    def wait_stream(self, stream: FakeStream) -> None:
        self.calls.append("wait_stream")


class FakeCuda:
    """Per-thread current streams (as CUDA's), the default one named "main", and what record_stream saw."""

    def __init__(self) -> None:
        self.main = FakeStream(name="main")
        self.local = threading.local()
        self.recorded: list[tuple[torch.Tensor, FakeStream]] = []
        self.streams: list[FakeStream] = []

    def current(self, device: object = None) -> FakeStream:
        return getattr(self.local, "stream", None) or self.main

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        previous = getattr(self.local, "stream", None)
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = previous

    def new_stream(self, device: object = None) -> FakeStream:
        self.streams.append(FakeStream(device))
        return self.streams[-1]


FAKE = FakeCuda()


def install(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Fresh fake CUDA state, in place of torch.cuda's stream and event API, for one test."""
    global FAKE
    FAKE = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", FAKE.new_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", FAKE.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", FAKE.current)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: FAKE.recorded.append((tensor, stream)))
    return FAKE


# ----------------------------------------------------------------------------- dataset.decode=cuda's batches
def jpeg_batches(tmp_path: Path, count: int, size: int = 8) -> list[Batch]:
    """`count` 32-px shapes JPEGs as the workers hand them to the decode stage: batches of `size` undecoded files,
    with their paths and stage times (stage timings on, the default)."""
    bundle = build_shapes("shapes", 32, [0.5] * 3, [0.25] * 3, False, str(tmp_path), count, 10, 0)
    paths = [bundle.train.path(i) for i in range(count)]
    data = [torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.uint8) for p in paths]
    times = BatchTimes(read=0.001, busy=0.001, finished=1.0, samples=size)
    return [
        Batch(EncodedBatch.pack(data[i : i + size]), torch.arange(i, i + size), (), tuple(paths[i : i + size]), times)
        for i in range(0, count, size)
    ]


def decoding_on_the_cpu(stage, transform, drop: bool) -> None:
    """The stage keeps its CUDA stream logic (faked); the decoder's own device work runs on the CPU."""
    decoder = JpegBatchDecoder(transform, drop=drop)
    stage.decoder = lambda batch, device: decoder(batch, torch.device("cpu"))
