"""nvImageCodec's decoder as torch sees it (dataset.gpu_decoder=nvimgcodec): a batch of files, whole or by region,
decoded in one call on the current CUDA stream, each image handed to torch without a copy, and whether region
decoding may be used in this process.

On CUDA the backends are the hardware engine (region_probe.HARDWARE_SHARE of each batch), the CUDA decoder behind
it (the rest, and what the engine refuses: progressive files, 4:1:1), then libjpeg-turbo on the host for anything
neither takes; without a GPU (the tests, the benchmark's CPU half), libjpeg-turbo alone: the same calls, host
images instead of device ones.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from imgtrain.data import region_probe
from imgtrain.data.gpu_decode import fence

log = logging.getLogger(__name__)

_REGIONS: dict[tuple[str, tuple[str, ...]], bool] = {}  # per device and backends: region decoding allowed here
_REGIONS_LOCK = threading.Lock()


class CodecDecoder:
    """One nvImageCodec decoder for `device` with `backends` (region_probe.BACKEND_KINDS' names, in the order they
    are tried; default: all of the GPU's, or the host's alone) and `threads` host threads (0: one per core)."""

    def __init__(
        self,
        device: torch.device,
        backends: tuple[str, ...] | None = None,
        share: float = region_probe.HARDWARE_SHARE,
        threads: int = 0,
    ) -> None:
        self.codec = region_probe.import_codec()
        self.device = device
        cuda = device.type == "cuda"
        self.backends = backends or (region_probe.GPU_BACKENDS if cuda else region_probe.CPU_BACKENDS)
        self.share = share
        index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
        self.index = index
        self.decoder = region_probe.make_decoder(self.codec, index, self.backends, share, threads)
        self.params = region_probe.decode_params(self.codec)
        self.held: list[Any] = []  # the last call's images, kept until the next fence (see `decode`)

    def streams(self, files: list[torch.Tensor]) -> list[Any]:
        """Each file's code stream (its header read, nothing decoded: `.height`, `.width` as stored), or why its
        header does not read (a string)."""
        out: list[Any] = []
        for data in files:
            try:
                out.append(self.codec.CodeStream(data.numpy()))
            except RuntimeError as error:  # nvImageCodec: "Failed to get image info"
                out.append(f"nvImageCodec cannot read its header ({str(error).strip() or 'unknown format'})")
        return out

    def decode(self, streams: list[Any], regions: np.ndarray | None = None) -> list[torch.Tensor | None]:
        """uint8 [3, h, w] as stored (views of nvImageCodec's interleaved images) on the device, None where no
        backend decoded the file; `regions` [n, 4] (top, bottom, left, right; stored pixels): only those. One
        batched call, on the current stream.

        The fence first (pytorch/vision#9606): the previous batch's images are read by kernels queued on this
        stream (the crops), and nvImageCodec's buffers are its own, freed when their last reference goes, which
        torch's stream order does not cover: the previous call's images are held until the stream is drained."""
        fence(self.device)
        self.held = []
        if regions is not None:
            region = self.codec.Region
            streams = [
                s.get_sub_code_stream(region=region(int(t), int(left), int(b), int(right)))
                for s, (t, b, left, right) in zip(streams, regions, strict=True)
            ]
        if not streams:
            return []
        cuda = self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device).cuda_stream if cuda else 0
        images = self.decoder.decode(streams, params=self.params, cuda_stream=stream)
        self.held = [image for image in images if image is not None]
        return [None if image is None else self._tensor(image) for image in images]

    def _tensor(self, image: Any) -> torch.Tensor:
        """[3, h, w] on the device: a device image through DLPack (its producer's work ordered before the current
        stream's), a host one (libjpeg-turbo's, or any image without a GPU) through NumPy, copied where needed."""
        if image.buffer_kind == self.codec.ImageBufferKind.STRIDED_DEVICE:
            try:
                tensor = torch.from_dlpack(image)
            except (TypeError, BufferError):  # a DLPack exchange this torch and nvImageCodec do not agree on
                tensor = torch.as_tensor(image, device=self.device)  # __cuda_array_interface__: the stream decoded on
        else:
            tensor = torch.from_numpy(np.asarray(image))
            if self.device.type == "cuda":  # a file only the host decoded: its one copy
                tensor = tensor.to(self.device)
        return tensor.permute(2, 0, 1)

    def describe(self) -> str:
        kinds = " > ".join(f"{name} ({self.share:g})" if name == "hardware" else name for name in self.backends)
        return f"nvImageCodec {self.codec.__version__} on {self.device}: {kinds}"


def regions_allowed(decoder: CodecDecoder) -> bool:
    """Whether `decoder` decodes regions in this process: the probe (region_probe) asked once per device and
    backends, in a child process on a GPU, said in one line either way."""
    key = (str(decoder.device), decoder.backends)
    with _REGIONS_LOCK:
        if key not in _REGIONS:
            if decoder.device.type == "cuda":
                found = region_probe.probe_in_child(decoder.index, decoder.backends, decoder.share)
            else:
                found = region_probe.probe_here(None, decoder.backends)
            _REGIONS[key] = bool(found["matched"])
            _say(decoder, found)
        return _REGIONS[key]


def refuse_regions(decoder: CodecDecoder, why: str) -> None:
    """Region decoding off for `decoder`'s device and backends, for the rest of the process, said in one line."""
    with _REGIONS_LOCK:
        _REGIONS[(str(decoder.device), decoder.backends)] = False
    log.warning("%s: region decoding off (%s); whole images decoded, cropped after", decoder.describe(), why)


def _say(decoder: CodecDecoder, found: dict[str, Any]) -> None:
    if found["matched"]:
        log.info(
            "%s: region decoding on (its probe's regions within %s levels of the full decode's crop)",
            decoder.describe(),
            found["max_difference"],
        )
        return
    why = found["error"] or (
        f"its probe's regions differ from the full decode's crop for {', '.join(found['failed'])} "
        f"(up to {found['max_difference']} levels)"
    )
    log.warning("%s: region decoding off (%s); whole images decoded, cropped after", decoder.describe(), why)
