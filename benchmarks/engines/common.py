"""The engine comparison's shared parts: one listing and one per-sample pipeline (decode, crop, flip) for all."""

import os
import random

import torch
from torchcodec.decoders import decode_image
from torchvision.transforms import v2

ROOT = os.environ.get("ENGINES_SRC", "")  # an image folder's train/ (class folders of JPEGs)
OUT = os.environ.get("ENGINES_OUT", "/tmp/engines")  # where each engine's shards are written
PER_SHARD = 400
BATCH = 64
TRANSFORM = v2.Compose([v2.RandomResizedCrop(56, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip()])


def listing() -> list[tuple[int, str, int]]:
    """(index, path, label) in a seeded random order, as every engine's documentation advises writing."""
    classes = sorted(os.listdir(ROOT))
    items = [
        (os.path.join(ROOT, c, f), i) for i, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(ROOT, c)))
    ]
    order = list(range(len(items)))
    random.Random(0).shuffle(order)
    return [(k, items[k][0], items[k][1]) for k in order]


def pipeline(data: bytes, label: int) -> tuple[torch.Tensor, int]:
    """The same work after the read for every engine: decode, then a random resized crop and a flip."""
    raw = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode="RGB")
    return TRANSFORM(raw).contiguous(), int(label)
