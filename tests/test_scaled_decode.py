"""dataset.scaled_decode (data/scaled_decode.py): JPEGs decoded at 1/2, 1/4 or 1/8 scale when the crop needs no
more, the same boxes and flips as the full decode, and EXIF orientation honoured on every decoding path."""

from __future__ import annotations

import importlib.util
import io
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from imgtrain.config.fields import AugmentOn
from imgtrain.data import batched, scaled_decode
from imgtrain.data.batched import CropSpec
from imgtrain.data.datasets import imagenet_transforms
from imgtrain.data.decoders import DECODE_ERRORS, OversizedImage, decode_bytes, error_reason
from imgtrain.data.gpu_decode import JpegBatchDecoder
from imgtrain.data.image_files import CorruptSampleError, EncodedFileDataset, ImageFileDataset
from imgtrain.data.jpeg import jpeg_header
from imgtrain.data.samples import GuardedSamples, collate
from imgtrain.data.scaled_decode import Reduced, decode_for_crop, denominator
from imgtrain.data.shards.downscale import MaxSide

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from photos import render  # noqa: E402  benchmarks/photos.py: photo-like content at quality 90

SIZE = 96  # the crop: a 1600x1200 photo then decodes at 1/2 to 1/8
TRAIN = CropSpec(224, scale=(0.08, 1.0), flip_p=0.5)


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def jpeg(array: np.ndarray, orientation: int = 1, **options) -> bytes:
    image, out = Image.fromarray(array), io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    image.save(out, "JPEG", quality=95, exif=exif, **options)
    return out.getvalue()


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Four photo-like JPEGs: landscape, portrait, an EXIF-rotated one (stored 1600x1200, shown 1200x1600) and one
    too small for any reduction at 96-px crops (as an ImageNet-sized file is at 224 px), which decodes in full."""
    root, rng = tmp_path_factory.mktemp("photos"), np.random.default_rng(0)
    paths = []
    shapes = ((1600, 1200, 1), (1200, 1600, 1), (1600, 1200, 6), (200, 150, 1))  # stored width, height, EXIF's
    for i, (width, height, orientation) in enumerate(shapes):
        stored = np.asarray(Image.open(io.BytesIO(render(width, height, rng))).convert("RGB"))
        (path := root / f"{i}.jpg").write_bytes(jpeg(stored, orientation))
        paths.append(str(path))
    return paths


def test_the_scale_leaves_the_crop_at_least_its_output_size() -> None:
    """The largest of 1/2, 1/4, 1/8 whose box still holds 224 px a side (the next would not); never a reduction for
    ImageNet-sized files; validation by the shorter side against the resize."""
    chosen: dict[tuple[int, int], set[int]] = {(2000, 3000): set(), (750, 1000): set()}
    for seed in range(300):
        for (height, width), found in chosen.items():
            d = denominator(height, width, seed, TRAIN)
            found.add(d)
            assert d == 1 or all(v // d >= 224 for v in _box(height, width, seed))
            assert d == 8 or any(v // (2 * d) < 224 for v in _box(height, width, seed))
        assert denominator(375, 500, seed, TRAIN) == 1
    # RandomResizedCrop's boxes take 8% to all of the image: of a 6-MP photo at least 1/2 is left out
    assert chosen == {(2000, 3000): {2, 4, 8}, (750, 1000): {1, 2}}
    assert denominator(2000, 3000, None, CropSpec(224, resize=256)) == 4  # 2000 / 4 = 500 >= 256; / 8 = 250 < 256
    assert denominator(2000, 3000, None, CropSpec(224)) == 8  # both sides to 224: 250 x 375 suffices


def _box(height: int, width: int, seed: int) -> tuple[int, int]:
    draws = batched.uniforms(np.array([seed]), batched.DRAWS)
    return tuple(int(v) for v in batched.random_boxes(np.array([height]), np.array([width]), draws, TRAIN)[0][2:])


@pytest.mark.parametrize("augment_on", [AugmentOn.workers, AugmentOn.device])
@pytest.mark.parametrize("split", ["train", "val"])
def test_scaled_decoding_crops_what_the_full_decode_crops(photos: list[str], split: str, augment_on) -> None:
    """The same boxes and flips, from the same seeds, drawn on the full size: each output within a few levels of
    the full decode's (the box's edges move by at most half a pixel of the smaller image, and libjpeg-turbo's
    scaled IDCT filters a little differently), far from another image's."""
    transform = imagenet_transforms(SIZE, mean=(0.5, 0.5, 0.5))[0 if split == "train" else 1]
    items = [(i % 4, 1000 + i) for i in range(12)] if split == "train" else [i % 4 for i in range(12)]
    outputs, sizes = {}, {}
    for scaled in (False, True):
        dataset = ImageFileDataset(photos, [0, 1, 2, 3], list("abcd"), transform, scaled=scaled)
        samples = GuardedSamples(dataset, augment_on=augment_on).__getitems__(items)
        sizes[scaled] = [tuple(s[0].image.shape[-2:]) for s in samples]
        batch = collate(samples).images
        outputs[scaled] = (batch.resampled() if augment_on == AugmentOn.device else batch).float()
    assert all(sizes[True][i][0] < sizes[False][i][0] for i in range(3))  # each photo decoded smaller...
    assert sizes[True][3] == sizes[False][3] == (150, 200)  # ...not the small file
    assert sizes[True][2][0] > sizes[True][2][1]  # the rotated photo upright, as the full decoder gives it
    difference = (outputs[True] - outputs[False]).abs().mean(dim=(1, 2, 3))
    other = (outputs[False] - outputs[False].roll(1, 0)).abs().mean(dim=(1, 2, 3))
    # Moving a box by 4 px of the full image (half a pixel at 1/8) changes this content's 96-px crop by 4.7-5.6
    # levels on average: the bound allows that much, an image away is ten times more
    assert difference.max() < 6.0 and other.min() > 50, (difference, other)


def test_both_bindings_decode_the_same_scale(photos: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """simplejpeg (when installed) and PIL's draft give the same size and nearly the same pixels."""
    if importlib.util.find_spec("simplejpeg") is None:
        pytest.skip("simplejpeg is not installed: only PIL's draft decodes at reduced scale here")
    data = as_tensor(Path(photos[2]).read_bytes())
    spec = CropSpec(SIZE, resize=110)
    fast = decode_for_crop(data, "p", None, None, spec)
    monkeypatch.setattr(scaled_decode, "simplejpeg", None)
    pil = decode_for_crop(data, "p", None, None, spec)
    assert isinstance(fast, Reduced) and isinstance(pil, Reduced) and fast.full == pil.full == (1600, 1200)
    assert fast.image.shape == pil.image.shape == (3, 200, 150)  # 1/8, upright
    assert (fast.image.float() - pil.image.float()).abs().mean() < 2.0


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_honoured_by_every_cpu_decoder(orientation: int) -> None:
    """As a viewer shows the photo (PIL's exif_transpose): the full decode, scaled decoding, and PIL's formats."""
    stored = np.asarray(Image.open(io.BytesIO(render(640, 480, np.random.default_rng(orientation)))).convert("RGB"))
    data = jpeg(stored, orientation)
    reference = torch.from_numpy(np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))).permute(2, 0, 1)
    full = decode_bytes(as_tensor(data), "p")
    reduced = decode_for_crop(as_tensor(data), "p", None, None, CropSpec(32, resize=36))
    assert full.shape == reference.shape and (full.float() - reference.float()).abs().mean() < 1.0
    assert isinstance(reduced, Reduced) and reduced.full == tuple(reference.shape[1:])
    assert reduced.image.shape[1:] == (reference.shape[1] // 8, reference.shape[2] // 8)
    small = torch.nn.functional.avg_pool2d(reference[None].float(), 8)[0]
    assert (reduced.image.float() - small).abs().mean() < 3.0  # the 1/8 decode is the same picture, upright
    tiff = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(stored).save(tiff, "TIFF", exif=exif)  # decoded by PIL
    assert decode_bytes(as_tensor(tiff.getvalue()), "p.tif").shape == reference.shape


def test_the_gpu_path_turns_what_nvjpeg_leaves_as_stored(photos: list[str]) -> None:
    """dataset.decode=cuda: the worker reads the orientation from the header, the decoder side turns the image
    (run here with torchvision's CPU decoder in nvJPEG's place: the same call, device cpu)."""
    files = EncodedFileDataset(photos, [0, 1, 2, 3], list("abcd"), None)
    batch = collate(GuardedSamples(files, replace=False).__getitems__([2, 3]))
    assert batch.images.orientations.tolist() == [6, 1]
    decoded = JpegBatchDecoder(lambda image: image[:, :8, :8])(batch, torch.device("cpu"))
    full = decode_bytes(as_tensor(Path(photos[2]).read_bytes()), "p")
    assert (decoded.images[0].float() - full[:, :8, :8].float()).abs().mean() < 2.0  # the upright corner


def test_the_pixel_limit_counts_the_pixels_decoded(photos: list[str]) -> None:
    """1600x1200 is above a 1-MP limit in full, not at 1/8 (200x150): validation at 96 px decodes it; a limit below
    even that names the scale."""
    data = as_tensor(Path(photos[0]).read_bytes())
    with pytest.raises(OversizedImage, match="1600x1200 pixels"):
        decode_bytes(data, "p", 1_000_000)
    assert decode_for_crop(data, "p", 1_000_000, None, CropSpec(SIZE, resize=110)).image.shape == (3, 150, 200)
    with pytest.raises(OversizedImage, match=r"200x150 pixels .* at 1/8 scale; not decoded"):
        decode_for_crop(data, "p", 10_000, None, CropSpec(SIZE, resize=110))


def test_files_scaled_decoding_does_not_apply_to_decode_as_before(tmp_path: Path) -> None:
    """CMYK and PNG decode in full; progressive JPEGs scale; a damaged header and a HEIC file are one line each,
    the same with and without scaled decoding."""
    array = np.asarray(Image.open(io.BytesIO(render(800, 600, np.random.default_rng(1)))).convert("RGB"))
    spec = CropSpec(32, resize=36)
    cmyk, png = io.BytesIO(), io.BytesIO()
    Image.fromarray(array).convert("CMYK").save(cmyk, "JPEG")
    Image.fromarray(array).save(png, "PNG")
    for data in (cmyk.getvalue(), png.getvalue()):
        assert torch.equal(decode_for_crop(as_tensor(data), "p", None, None, spec), decode_bytes(as_tensor(data), "p"))
    assert decode_for_crop(as_tensor(jpeg(array, progressive=True)), "p", None, None, spec).image.shape == (3, 75, 100)
    damaged = bytearray(jpeg(array))
    damaged[2:6] = b"\x00\x00\x00\x00"  # the first marker's header
    heic = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64)
    for name, data in (("damaged.jpg", bytes(damaged)), ("photo.heic", heic)):
        (tmp_path / name).write_bytes(data)
    reasons = {}
    for scaled in (False, True):
        dataset = ImageFileDataset([str(tmp_path / "damaged.jpg"), str(tmp_path / "photo.heic")], [0, 0], ["a"], None)
        dataset.scaled = scaled
        for index in (0, 1):
            with pytest.raises(CorruptSampleError) as error:
                dataset.decoded(index, (0, spec))
            reasons.setdefault(index, set()).add(error.value.reason)
    assert all(len(found) == 1 for found in reasons.values()), reasons
    assert reasons[1] == {
        "a HEIC/HEIF image (brand heic), which neither TorchCodec nor Pillow decodes: convert it to JPEG first "
        "(e.g. `heif-convert`, or Pillow with the pillow-heif plugin)"
    }
    with pytest.raises(DECODE_ERRORS) as error:
        decode_bytes(as_tensor(bytes(damaged)), "p")
    assert "\n" not in error_reason(error.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run `make test-gpu` on a GPU")
def test_on_a_gpu_nvjpeg_turns_exif_and_the_device_crops_scaled_images(photos: list[str]) -> None:
    """dataset.decode=cuda: nvJPEG's image of the EXIF-rotated photo turned upright as TorchCodec's; and a batch
    decoded at reduced scale, cropped on the device (data.augment_on=device), as the full decode cropped there."""
    cuda = torch.device("cuda", 0)
    files = EncodedFileDataset(photos, [0, 1, 2, 3], list("abcd"), None)
    batch = collate(GuardedSamples(files, replace=False).__getitems__([2]))
    decoded = JpegBatchDecoder(lambda image: image)(batch, cuda).images[0].cpu()
    full = decode_bytes(as_tensor(Path(photos[2]).read_bytes()), "p")
    assert decoded.shape == full.shape and (decoded.float() - full.float()).abs().mean() < 2.0
    transform = imagenet_transforms(SIZE, mean=(0.5, 0.5, 0.5))[0]
    items, outputs = [(i % 3, 1000 + i) for i in range(6)], []
    for scaled in (False, True):
        dataset = ImageFileDataset(photos, [0, 1, 2, 3], list("abcd"), transform, scaled=scaled)
        raw = collate(GuardedSamples(dataset, augment_on=AugmentOn.device).__getitems__(items)).images
        outputs.append(raw.to(cuda).resampled().float().cpu())
    assert (outputs[1] - outputs[0]).abs().mean(dim=(1, 2, 3)).max() < 6.0


SEEDS = Path(__file__).resolve().parent / "fuzz_seeds" / "jpeg"


@pytest.mark.parametrize("seed", ["progressive_420.jpg", "nonint_baseline.jpg"])
@pytest.mark.parametrize("binding", ["simplejpeg", "PIL"])
def test_a_progressive_header_counts_in_full_at_any_scale(seed: str, binding: str, monkeypatch) -> None:
    """libjpeg holds a progressive file's (or a one-component-a-scan file's) DCT coefficients whole, at any output
    scale: its header's pixels count, not those at 1/8. A 16000 x 16000 claim under a 4-MP limit (250,000 px at 1/8)
    held 781 MB of coefficients before being refused; now it is refused unread, as in a full decode."""
    if binding == "PIL":
        monkeypatch.setattr(scaled_decode, "simplejpeg", None)
    data = bytearray((SEEDS / seed).read_bytes())
    sof = next(p for p in range(2, len(data)) if data[p] == 0xFF and data[p + 1] in (0xC0, 0xC2))
    data[sof + 5 : sof + 9] = (16000).to_bytes(2, "big") * 2
    started = time.perf_counter()
    with pytest.raises(OversizedImage, match=r"16000x16000 pixels \(256 MP\) .* held whole at any scale"):
        decode_for_crop(as_tensor(bytes(data)), "p", 4_000_000, 0, TRAIN)
    assert time.perf_counter() - started < 0.5  # refused from the header: nothing decoded
    small = decode_for_crop(as_tensor((SEEDS / seed).read_bytes()), "p", 4_000_000, None, CropSpec(8))
    assert isinstance(small, Reduced) and small.image.shape == (3, 8, 12)  # within the limit: still at 1/4


@pytest.mark.parametrize("pil_limit", [1_000_000, 900_000])  # the photo's 1.92 MP above it (PIL warns), above twice
def test_without_simplejpeg_the_template_s_limit_is_the_only_one(
    photos: list[str], pil_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PIL's draft decodes at reduced scale where simplejpeg is missing (the GPU box): PIL's own bomb guard (here
    lowered below a 1600x1200 photo, as a 100-MP photo meets its default of 89 MP) neither warns about it nor refuses
    it, and dataset.max_image_pixels counts the pixels at 1/8 as with simplejpeg."""
    monkeypatch.setattr(scaled_decode, "simplejpeg", None)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", pil_limit)
    dataset = ImageFileDataset(photos[:1], [0], ["a"], None, max_pixels=1_000_000, scaled=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a DecompressionBombWarning would be one per file
        decoded, _ = dataset.decoded(0, (None, CropSpec(SIZE, resize=110)))
    assert isinstance(decoded, Reduced) and decoded.image.shape == (3, 150, 200)
    assert pil_limit == Image.MAX_IMAGE_PIXELS  # PIL's setting put back


def test_one_file_turns_one_way_on_every_path() -> None:
    """An XMP segment before an EXIF orientation of 6: TorchCodec reads the first APP1 alone, so the file is shown
    as stored; the header reader (scaled decoding, decode=cuda's worker) and --max-side's downscale turn it the same
    way (the scaled decode turned it, the full decode did not: 256x128 and 128x256 for one file)."""
    data = (SEEDS / "xmp_before_exif6.jpg").read_bytes()
    full = decode_bytes(as_tensor(data), "p")
    reduced = decode_for_crop(as_tensor(data), "p", None, None, CropSpec(8))
    assert full.shape == (3, 32, 48) and isinstance(reduced, Reduced) and reduced.full == (32, 48)
    assert reduced.image.shape == (3, 8, 12)
    assert jpeg_header(data).orientation == 1  # what decode=cuda turns by
    packed = decode_bytes(as_tensor(MaxSide(24).shrunk(data)), "p")
    assert packed.shape == (3, 16, 24)
