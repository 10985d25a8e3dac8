"""dataset.decode=cuda: JPEG batches decoded with nvJPEG and transformed on the GPU, in a thread of their own.

torchvision's batched GPU decode blocks its caller until the batch is decoded, so it runs in a background
thread on its own CUDA stream, ahead of the model. Every decode is fenced against nvJPEG's stream-order bug.
dataset.gpu_decoder=nvimgcodec puts nvImageCodec's region decoder (data/region_decode.py) in the same thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from imgtrain.common.errors import RunError
from imgtrain.data import batched, resample
from imgtrain.data.ahead import AHEAD, BatchesAhead
from imgtrain.data.copies import to_device
from imgtrain.data.decoders import upright
from imgtrain.data.jpeg import EncodedBatch
from imgtrain.data.samples import Batch
from imgtrain.data.stages import StreamTimer


class GpuJpegBatches(BatchesAhead):
    """dataset.decode=cuda: a background thread (data/ahead.py) decodes each batch's JPEGs and transforms them on
    its own CUDA stream, up to `depth` batches ahead of the model; `decoder` (a Batch and the device to the decoded
    Batch): another than torchvision's, e.g. region_decode.RegionBatchDecoder.

    torchvision's GPU decode blocks the calling thread until the batch is decoded; in a thread of its own it
    overlaps the training step, so the loop's data wait (time blocked in `next()`) is real starvation. A batch is
    finished when the thread hands it over: what the loop waits for before that is the workers' reading or this
    decode, which `timer` times on the decode stream with CUDA events, read at the logging window: from when the
    stream reaches the batch to its last crop kernel, nvJPEG's blocking decode included (wall time on the stream,
    not GPU work). The thread never waits for its own stream otherwise, so it fetches the next batch while the GPU
    still resizes this one.
    """

    def __init__(
        self,
        batches: Iterator[Batch],
        transform: Any,
        device: torch.device,
        depth: int = AHEAD,
        drop: bool = False,
        timer: StreamTimer | None = None,
        decoder: Callable[[Batch, torch.device], Batch] | None = None,
    ) -> None:
        # dataset.gpu_decoder's (data/region_decode.py: batch_decoder); torchvision's by default
        self.decoder = decoder or JpegBatchDecoder(transform, drop=drop)
        prepare = lambda batch: self.decoder(batch, device)  # noqa: E731 - the attribute a test may swap
        super().__init__(batches, prepare, device, name="gpu-jpeg-decode", depth=depth, timer=timer, handed_over=True)


def decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | str]:
    """Decode JPEG byte tensors on `device`: each entry is a uint8 image [3, H, W], or why that file failed.

    One bad file fails torchvision's whole batched call, so a failed batch is decoded again file by file, behind one
    fence: the decodes themselves queue no kernel, so nothing freed between them is still read on the stream.
    """
    try:
        fence(device)
        return list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        fence(device)  # the failed call's outputs are freed: drained once, not once per file
        decoded: list[torch.Tensor | str] = []
        for data in encoded:
            try:
                decoded.append(decode_jpeg([data], mode=ImageReadMode.RGB, device=device)[0])
            except RuntimeError as error:
                decoded.append(str(error).strip().splitlines()[0] if str(error).strip() else "cannot be decoded")
        return decoded


def fence(device: torch.device) -> None:
    """Drain the current stream before nvJPEG writes. torchvision allocates the outputs on the current stream,
    then nvJPEG writes them from its own (its hardware engine ignores stream order altogether): memory freed while
    kernels queued on this stream still read it can be handed straight to the decoder (pytorch/vision#9606,
    meta-pytorch/torchcodec#1634). On the decode stream that is only the previous batch's crops, not the training
    step."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


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
        """`batch` decoded and transformed on `device`: float images, labels there (copied from pinned memory, so
        the decode thread never waits for the stream's kernels), the unreadable files added to `skipped`, its
        sources and stage times kept."""
        if batch.images is None:  # validation: the workers rejected every file of this batch
            return batch._replace(labels=to_device(batch.labels, device))
        encoded: EncodedBatch = batch.images
        decoded = decode_jpegs(encoded.files(), device)
        if encoded.orientations is not None:  # nvJPEG ignores EXIF: turned here, as the CPU decoders turn them
            turns = zip(decoded, encoded.orientations.tolist(), strict=True)
            decoded = [upright(image, o) if isinstance(image, torch.Tensor) else image for image, o in turns]
        failed = tuple((batch.sources[i], why) for i, why in enumerate(decoded) if isinstance(why, str))
        take, seeded = readable_selection(decoded, batch.sources, self.drop)
        labels = batch.labels if not failed else batch.labels[torch.as_tensor(take, dtype=torch.long)]
        images = self._transform([decoded[i] for i in take], encoded.seeds.numpy()[seeded]) if take else None
        return batch._replace(
            images=images,
            labels=to_device(labels, device),
            skipped=batch.skipped + failed,
            sources=tuple(batch.sources[i] for i in take),
        )

    def _transform(self, images: list[torch.Tensor], seeds: np.ndarray) -> torch.Tensor:
        """The batch as the split's transform makes it: float in 0..255 (the per-image fallback: uint8)."""
        if self.spec is None:
            return torch.stack([self.per_image(image) for image in images])
        # Each sample's box and flip from its seed (exact on a resume), its size from the decoded shape
        plan = resample.plan_batch(*resample.sizes_of(images), seeds, self.spec)
        return resample.resample_images(images, plan, self.spec.size)  # in chunks of windows: bounded memory


def readable_selection(
    decoded: list[torch.Tensor | str], sources: tuple[str, ...], drop: bool
) -> tuple[list[int], list[int]]:
    """(the decoded image each output takes, the sample whose seed crops it). An unreadable file (its reason, a
    string) is left out (`drop`: validation) or replaced by the next readable image of the batch, with its label,
    cropped by the replaced sample's seed (training: the batch keeps its shape)."""
    good = [i for i, image in enumerate(decoded) if isinstance(image, torch.Tensor)]
    if drop or len(good) == len(decoded):
        return good, good
    if not good:
        raise RunError(
            f"no image of a batch of {len(decoded)} could be decoded on the GPU (e.g. {sources[0]}: "
            f"{decoded[0]}): check the files, or use dataset.decode=cpu"
        )
    readable = set(good)
    take = [i if i in readable else next((j for j in good if j > i), good[0]) for i in range(len(decoded))]
    return take, list(range(len(decoded)))
