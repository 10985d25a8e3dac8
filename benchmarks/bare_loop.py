"""The baseline for train.py's instrumentation overhead: a minimal hand-written loop, nothing else.

Same dataset files and transforms, model, optimiser, batch size, DataLoader settings, precision and thread
count as `python train.py` with its defaults; no logging, no monitor thread, no metrics, no checkpoints.
Like train.py it validates at every epoch end and leaves that time out of its clock, as train.py's throughput
windows do: the first training steps after a validation pass re-fault the memory it released (about 0.4 s on
the 2-core machine), a cost of validating, not of instrumentation, which both loops must pay alike.
Prints one JSON line: {"images_per_sec": ..., "steps": ..., "seconds": ...}.

Its update step is written out here on purpose, not taken from `optim.Step` (which the training loop and the
tune probe share): the reference must not move when the template's code does.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader

from imgtrain.data.datasets import build_shapes
from imgtrain.data.loader import auto_num_workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing, as train.py does")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    bundle = build_shapes(
        "shapes", args.image_size, [0.5] * 3, [0.25] * 3, True, f"{args.data_dir}/shapes", 5000, 1000, 0
    )
    workers = auto_num_workers(1)
    loader = DataLoader(
        bundle.train,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers else None,
    )
    val_loader = DataLoader(  # as train.py's: twice the batch, the same workers, kept between epochs
        bundle.val,
        batch_size=2 * args.batch_size,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers else None,
    )
    memory_format = torch.channels_last if cuda else torch.contiguous_format
    model = torchvision.models.resnet18(num_classes=10).to(device, memory_format=memory_format)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, fused=True)  # as train.py
    mean = torch.tensor(bundle.mean, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(bundle.std, device=device).view(1, 3, 1, 1) * 255
    dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32

    def normalized(images: torch.Tensor) -> torch.Tensor:
        images = images.to(device, non_blocking=cuda).to(torch.float32, memory_format=memory_format)
        return (images - mean) / std

    @torch.no_grad()
    def validate() -> None:
        model.eval()
        correct = torch.zeros((), device=device)
        for images, labels in val_loader:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(normalized(images))
            correct += (logits.argmax(dim=1) == labels.to(device, non_blocking=cuda)).sum()
        correct.item()  # waits for the pass to end
        model.train()

    step, started, images_seen, validating_s = 0, 0.0, 0, 0.0
    while step < args.steps:
        if step:  # an epoch ended: validate, off the clock
            paused = time.perf_counter()
            validate()
            validating_s += time.perf_counter() - paused
        for images, labels in loader:
            labels = labels.to(device, non_blocking=cuda)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = F.cross_entropy(model(normalized(images)), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.warmup:
                if cuda:
                    torch.cuda.synchronize()
                started, validating_s = time.perf_counter(), 0.0
            elif step > args.warmup:
                images_seen += labels.shape[0]
            if step == args.steps:
                break
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started - validating_s
    print(json.dumps({"images_per_sec": images_seen / seconds, "steps": args.steps - args.warmup, "seconds": seconds}))


if __name__ == "__main__":
    main()
