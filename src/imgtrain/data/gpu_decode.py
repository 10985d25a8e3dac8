"""dataset.decode=cuda: JPEG batches decoded with nvJPEG and transformed on the GPU, in a thread of their own.

torchvision's batched GPU decode blocks its caller until the batch is decoded, so it runs in a background
thread on its own CUDA stream, ahead of the model. Every decode is fenced against nvJPEG's stream-order bug.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from imgtrain.data import batched, resample
from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.samples import Batch
from imgtrain.data.stages import StreamTimer
from imgtrain.errors import RunError


class GpuJpegBatches:
    """dataset.decode=cuda: a background thread decodes each batch's JPEGs with nvJPEG and transforms them on
    its own CUDA stream, up to `depth` batches ahead of the model.

    torchvision's GPU decode blocks the calling thread until the batch is decoded; in a thread of its own it
    overlaps the training step, so the loop's data wait (time blocked in `next()`) is real starvation. Use it
    as a context manager: leaving stops the thread before the loader is used again. `inner` is the loader's
    iterator (for explaining its failures). `timer` times each batch's work on the decode stream with CUDA
    events, read at the logging window: the thread never waits for its own stream, so it fetches the next
    batch while the GPU still resizes this one.
    """

    _END = object()

    def __init__(
        self,
        batches: Iterator[Batch],
        transform: Any,
        device: torch.device,
        depth: int = 2,
        drop: bool = False,
        timer: StreamTimer | None = None,
    ) -> None:
        self.inner = batches
        self.device = device
        self.timer = timer or StreamTimer(device, enabled=False)
        self.decoder = JpegBatchDecoder(transform, drop=drop)
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._decode_all, name="gpu-jpeg-decode", daemon=True)

    def _decode_all(self) -> None:
        """The thread: decode batch after batch; an error is handed to the loop, which raises it."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for batch in self.inner:
                    if self.stopping.is_set():
                        return
                    with self.timer.span(stream):
                        decoded = self.decoder(batch, self.device)
                    done = stream.record_event() if stream is not None else None
                    self._hand_over((decoded, done))
            self._hand_over(self._END)
        except BaseException as error:  # noqa: BLE001 - raised again in the training thread
            self._hand_over(error)

    def _hand_over(self, item: Any) -> None:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __enter__(self) -> GpuJpegBatches:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        while self.thread.is_alive():  # the thread may be waiting for a worker's batch: let it finish
            with contextlib.suppress(queue.Empty):
                self.ready.get(timeout=0.1)

    def __iter__(self) -> GpuJpegBatches:
        return self

    def __next__(self) -> Batch:
        item = self.ready.get()
        if item is self._END:
            self.ready.put(self._END)  # every later next() ends too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, done = item
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)  # the GPU, not this thread, waits for the decode stream
            if batch.images is not None:  # None: a validation batch whose images were all unreadable
                batch.images.record_stream(current)  # not reused by the decode stream while the model reads it
            batch.labels.record_stream(current)
        return batch


def decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | str]:
    """Decode JPEG byte tensors on `device`: each entry is a uint8 image [3, H, W], or why that file failed.

    One bad file fails torchvision's whole batched call, so a failed batch is decoded again file by file.
    """
    try:
        return list(_fenced_decode(encoded, device))
    except RuntimeError:
        decoded: list[torch.Tensor | str] = []
        for data in encoded:
            try:
                decoded.append(_fenced_decode([data], device)[0])
            except RuntimeError as error:
                decoded.append(str(error).strip().splitlines()[0] if str(error).strip() else "cannot be decoded")
        return decoded


def _fenced_decode(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if device.type == "cuda":
        # torchvision allocates the outputs on the current stream, then nvJPEG writes them from its own stream
        # (its hardware engine ignores stream order altogether). Memory freed while kernels queued on this
        # stream still read it can be handed straight to the decoder: drain the stream first
        # (pytorch/vision#9606, meta-pytorch/torchcodec#1634). On the prefetch stream that is only the
        # previous batch's resizes, not the training step.
        torch.cuda.current_stream(device).synchronize()
    return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)


class JpegBatchDecoder:
    """Decode a Batch of undecoded JPEGs and apply the split's transform, batched where the transform allows.

    Files that fail to decode are replaced by another image of the same batch (and its label), or with `drop`
    (validation) left out, and reported in `skipped`, as GuardedSamples does for the CPU path, so they count
    against data.max_bad_samples.
    """

    def __init__(self, transform: Any, drop: bool = False) -> None:
        self.drop = drop
        # The transforms built in data/datasets.py: the whole batch cropped, resized and flipped in two matmuls
        # (data/resample.py). Any other transform: applied to each image, then stacked.
        self.spec = batched.spec_of(transform)
        self.per_image = transform

    def __call__(self, batch: Batch, device: torch.device) -> Batch:
        encoded: EncodedBatch = batch.images
        decoded = decode_jpegs(encoded.files(), device)
        good = [i for i, image in enumerate(decoded) if isinstance(image, torch.Tensor)]
        labels, skipped, seeds = batch.labels, list(batch.skipped), encoded.seeds.numpy()
        skipped += [(batch.sources[i], image) for i, image in enumerate(decoded) if isinstance(image, str)]
        if self.drop and len(good) < len(decoded):
            decoded, labels, seeds = [decoded[i] for i in good], labels[good], seeds[good]
        elif not good and decoded:
            raise RunError(
                f"no image of a batch of {len(decoded)} could be decoded on the GPU (e.g. {batch.sources[0]}: "
                f"{decoded[0]}): check the files, or use dataset.decode=cpu"
            )
        elif len(good) < len(decoded):
            labels = labels.clone()
            for i, image in enumerate(decoded):
                if isinstance(image, str):  # the stand-in's image and label, cropped by this sample's seed
                    stand_in = next((j for j in good if j > i), good[0])
                    decoded[i], labels[i] = decoded[stand_in], labels[stand_in]
        if not decoded:  # validation, every image unreadable: no images, and no labels (on the device as usual)
            return Batch(None, labels.to(device, non_blocking=True), tuple(skipped))
        images = self._transform(decoded, seeds)
        return Batch(images, labels.to(device, non_blocking=True), tuple(skipped))

    def _transform(self, images: list[torch.Tensor], seeds: np.ndarray) -> torch.Tensor:
        """The batch as the split's transform makes it: float in 0..255 (the per-image fallback: uint8)."""
        if self.spec is None:
            return torch.stack([self.per_image(image) for image in images])
        # Each sample's box and flip from its seed (exact on a resume), its size from the decoded shape
        plan = resample.plan_batch(*resample.sizes_of(images), seeds, self.spec)
        return resample.resample(resample.canvas(images), torch.from_numpy(plan), self.spec.size)
