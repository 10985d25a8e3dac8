"""The bare-loop reference for the GPU compute ceilings: a hand-written step on one random batch on the GPU.

The same model builder, fused AdamW, channels_last, bf16 autocast and uint8-to-float normalisation as
`python train.py mode=compute`, and nothing else: no logging, no monitor, no metrics. Prints one line per
configuration. Used for BENCHMARKS.md's H100 rows (issue 10); needs CUDA.

    python benchmarks/bare_gpu_loop.py               # ResNet-18 CIFAR-style at 32 px, batch 512
    python benchmarks/bare_gpu_loop.py --all         # also: not fused, NCHW, batch 1024, compiled, ResNet-50
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from imgtrain.train.model import build_torchvision


def ceiling(arch: str, cifar: bool, size: int, batch: int, **options: bool) -> float:
    """Images/s of fused (or not) AdamW steps on one uint8 batch already on the GPU, after a warm-up."""
    channels_last, compiled, fused = options["channels_last"], options["compiled"], options["fused"]
    steps, warmup = options.get("steps", 250), options.get("warmup", 50)
    device = torch.device("cuda")
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = build_torchvision(arch, 10 if cifar else 1000, cifar_stem=cifar).to(device, memory_format=memory_format)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)
    step_model = torch.compile(model) if compiled else model
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        inputs = (images.to(torch.float32, memory_format=memory_format) - 127.0) / 64.0
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(step_model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    rate = steps * batch / (time.perf_counter() - start)
    print(f"{arch}{'_cifar' if cifar else ''} {size}px b{batch} {options}: {rate:,.0f} img/s", flush=True)
    torch._dynamo.reset()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="every variant, not only the default row")
    args = parser.parse_args()
    default = {"channels_last": True, "compiled": False, "fused": True}
    ceiling("resnet18", True, 32, 512, **default)
    if args.all:
        ceiling("resnet18", True, 32, 512, **{**default, "channels_last": False})
        ceiling("resnet18", True, 32, 512, **{**default, "fused": False})
        ceiling("resnet18", True, 32, 1024, **default)
        ceiling("resnet18", True, 32, 512, **{**default, "compiled": True})
        ceiling("resnet50", False, 224, 256, **default, steps=60, warmup=15)
        ceiling("resnet50", False, 224, 256, **{**default, "compiled": True}, steps=60, warmup=15)


if __name__ == "__main__":
    main()
