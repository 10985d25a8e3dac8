"""The training loader on one core against a bare decode of the same files: how much of a core's JPEG decoding
rate the loader keeps, with the crop, resize, flip, batching and bookkeeping on top.

On ImageNet-sized JPEGs (benchmarks/photos.py's photo-like content at quality 90, 500x375, a quarter 375x500,
`--files` distinct files), in this process on one thread (torch.set_num_threads(1)), three ways of reading one
epoch of the same files in the same order:
- `bare`: each file read and decoded by the template's CPU decoder (data/decoders.py `cpu_decoder`), nothing else;
- `torchvision per sample`: the same, then the split's own transform (RandomResizedCrop 224 and flip, torchvision
  v2) per image, and torch.stack per batch;
- `loader`: the training loader train.py builds with `dataset=imagefolder data.num_workers=0` (compose, validate,
  pipeline.build_data: the same code path, rrc_flip at 224 px, batches of `--batch`), iterated over the epoch.
Rounds interleave the three (the order rotated every round), each round reads the same epoch, and each row gives
the median images/s over the rounds, the range, and the median (range) of the per-round ratios to `bare`.

`--instructions` also counts the instructions of one epoch of each way under valgrind's callgrind (a child process
per way, collection toggled around the measured pass, after one pass that warms it up) on the first
`--instruction-files` files: a figure that does not depend on what else the machine runs, and the functions it
goes to (self cost, per image). Needs valgrind, a C compiler and valgrind's headers (the client request that
toggles collection); without them the counts are left out, and said so.

    python benchmarks/per_core.py --files 512 --rounds 5 --instructions --json per_core.json

`make bench` runs it as its `per-core` section (`bench.py --only per-core`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))
import photos  # noqa: E402  benchmarks/photos.py
from hydra import compose, initialize_config_dir  # noqa: E402

from imgtrain.config.validate import validate  # noqa: E402
from imgtrain.data.decoders import cpu_decoder, read_file  # noqa: E402
from imgtrain.data.pipeline import build_data  # noqa: E402
from imgtrain.host import dist  # noqa: E402
from imgtrain.train.cli import register  # noqa: E402

WAYS = ("bare", "torchvision per sample", "loader")
SIZE = (500, 375)  # ImageNet's most common size (photos.py)
QUICK = ["--files", "16", "--batch", "8", "--rounds", "1"]
# The client request that starts and stops callgrind's counting (valgrind/callgrind.h), for ctypes
TOGGLE_C = "#include <valgrind/callgrind.h>\nvoid toggle_collect(void) { CALLGRIND_TOGGLE_COLLECT; }\n"
TOP_FUNCTIONS = 12


def make_folder(root: Path, files: int, seed: int = 0) -> Path:
    """root/jpegs-N: train/c{0,1}/*.jpg (`files` rendered photos) and 4 in val/; made once."""
    folder, done = root / f"jpegs-{files}-seed{seed}", root / f"jpegs-{files}-seed{seed}" / "done"
    if done.exists():
        return folder
    rng = np.random.default_rng(seed)
    for split, count in (("train", files), ("val", 4)):
        for i in range(count):
            width, height = SIZE[::-1] if i % 4 == 3 else SIZE  # a quarter portrait, as photos.py draws them
            path = folder / split / f"c{i % 2}" / f"{i:05d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(photos.render(width, height, rng))
    done.write_text("")
    return folder


def subset(folder: Path, files: int) -> Path:
    """The first `files` training files of `folder` (and its val/), hard-linked into a folder of their own."""
    target = folder.parent / f"{folder.name}-first{files}"
    if (target / "done").exists():
        return target
    for split, count in (("train", files), ("val", 4)):
        for path in sorted((folder / split).rglob("*.jpg"), key=lambda p: p.name)[:count]:  # both classes
            link = target / path.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                os.link(path, link)
    (target / "done").write_text("")
    return target


class Ways:
    """The three ways over one folder, built once: the training loader train.py builds, and the same files in the
    loader's order for the other two."""

    def __init__(self, folder: Path, batch: int, workdir: Path) -> None:
        register()
        overrides = ["dataset=imagefolder", f"dataset.root={folder}", "dataset.augment=rrc_flip"]
        overrides += ["dataset.image_size=224", f"data.batch_size={batch}", "data.num_workers=0"]
        overrides += [f"output_dir={workdir}"]
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
            settings = validate(compose("config", overrides=overrides))
        self.data = build_data(settings, dist.DistInfo(), torch.device("cpu"), torch.contiguous_format, workdir)
        self.data.start_epoch(0, 0)
        dataset = self.data.bundle.train
        self.paths = [dataset.path(int(i)) for i in self.data.train.sampler.order()[0]]
        self.transform, self.batch = dataset.transform, batch
        self.decode = cpu_decoder().decode
        self.stage_ms: dict[str, float] = {}

    def run(self, way: str) -> int:
        """One epoch of `way`; the images it made."""
        if way == "bare":
            for path in self.paths:
                self.decode(read_file(path))
            return len(self.paths)
        if way == "torchvision per sample":
            for start in range(0, len(self.paths) - self.batch + 1, self.batch):
                torch.stack([self.transform(self.decode(read_file(p))) for p in self.paths[start : start + self.batch]])
            return len(self.paths) // self.batch * self.batch
        self.data.start_epoch(0, 0)  # the same epoch, the same crops, every round
        images, sums = 0, dict.fromkeys(("read", "decode", "augment", "collate"), 0.0)
        for batch in self.data.train:
            images += len(batch.labels)
            for stage in sums if batch.times else ():
                sums[stage] += getattr(batch.times, stage)
        self.stage_ms = {stage: 1000 * seconds / images for stage, seconds in sums.items()}
        return images


def measure(folder: Path, batch: int, rounds: int, workdir: Path) -> dict:
    """Interleaved rounds of the three ways: images/s per round, and the loader's stage ms per image."""
    ways = Ways(folder, batch, workdir)
    for way in WAYS:  # warm-up: the decoder's first call, the page cache, the loader's first batch
        ways.run(way)
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    cpu_rates: dict[str, list[float]] = {way: [] for way in WAYS}
    stages = []
    for round_ in range(rounds):
        turn = round_ % len(WAYS)
        for way in WAYS[turn:] + WAYS[:turn]:
            started, cpu_started = time.perf_counter(), time.thread_time()
            images = ways.run(way)
            rates[way].append(images / (time.perf_counter() - started))
            cpu_rates[way].append(images / (time.thread_time() - cpu_started))
        stages.append(ways.stage_ms)
    ways.data.close()
    stage_ms = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    return {"rates": rates, "cpu_rates": cpu_rates, "loader_stage_ms": stage_ms}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def summary(rates: dict[str, list[float]]) -> dict:
    """Per way: images/s and its ratio to `bare` of the same round, median and range."""
    return {
        way: {
            "images_per_sec": _spread(values),
            "x_bare": _spread([v / b for v, b in zip(values, rates["bare"], strict=True)]),
        }
        for way, values in rates.items()
    }


# ----------------------------------------------------------------------------- instruction counts (callgrind)
def _toggle_library(workdir: Path) -> Path | str:
    """The compiled client request, or why there is none."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if shutil.which("valgrind") is None or compiler is None:
        return "not measured: needs valgrind and a C compiler"
    source, library = workdir / "toggle.c", workdir / "libtoggle.so"
    source.write_text(TOGGLE_C)
    built = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], capture_output=True)
    if built.returncode != 0:
        return f"not measured: the client request did not compile (valgrind's headers?): {built.stderr[-200:]!r}"
    return library


def instructions(folder: Path, batch: int, workdir: Path) -> dict:
    """Each way's instructions per image over one epoch of `folder`, counted by callgrind in a child process of its
    own (all three at once: counts do not depend on the load), with the functions they go to."""
    library = _toggle_library(workdir)
    if isinstance(library, str):
        return {"note": library}
    children = {}
    for way in WAYS:
        out = workdir / f"callgrind.{way.split()[0]}.out"
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={out}", sys.executable]
        cmd += [__file__, "--child", way, "--root", str(folder), "--batch", str(batch), "--toggle", str(library)]
        cmd += ["--workdir", str(workdir / f"run-{way.split()[0]}")]
        children[way] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    counts = {}
    for way, (out, child) in children.items():
        stdout, stderr = child.communicate()
        if child.returncode != 0:
            return {"note": f"not measured: the {way} child failed: {stderr.strip().splitlines()[-1:]}"}
        images = json.loads(stdout.strip().splitlines()[-1])["images"]
        total = int(re.search(r"^summary: (\d+)", out.read_text(), re.MULTILINE)[1])
        counts[way] = {"images": images, "per_image": total / images, "top": top_functions(out, images)}
    bare = counts["bare"]["per_image"]
    for row in counts.values():
        row["bare_over_this"] = bare / row["per_image"]  # the ratio images/s would have at equal instruction rates
    return {"note": "measured", "files": len(list((folder / "train").rglob("*.jpg"))), "ways": counts}


def _short(name: str) -> str:
    """A callgrind function name without its arguments, return type, namespaces' noise and file."""
    library = re.search(r"\[([^\]]+)\]\s*$", name)
    name = re.sub(r"\s*\[[^\]]+\]\s*$", "", name)
    name = name.split(":", 1)[1] if name.startswith("???:") else name.rsplit(":", 1)[-1]  # "file:function"
    name = name.replace("(anonymous namespace)::", "")
    kernel = re.search(r"(\w+)(?:<[^<>]*>)?\((?:at::)?TensorIterator", name)  # a TensorIterator loop's kernel
    while re.search(r"<[^<>]*>", name):
        name = re.sub(r"<[^<>]*>", "", name)  # template arguments, innermost first
    name = re.sub(r"\(.*$", "", name).split(" ")[-1] + (f" [{kernel[1]}]" if kernel else "")
    return f"{name} ({Path(library[1]).name.split('.')[0]})" if library else name


def top_functions(out: Path, images: int) -> list[tuple[str, float]]:
    """The TOP_FUNCTIONS functions with the most instructions of their own, per image."""
    text = subprocess.run(["callgrind_annotate", str(out)], capture_output=True, text=True).stdout
    rows = []
    for line in text.split("file:function", 1)[-1].splitlines():
        found = re.match(r"\s*([\d,]+)\s+\([\s\d.]+%\)\s+(.+)$", line)
        if found:
            rows.append((_short(found[2]), int(found[1].replace(",", "")) / images))
    return rows[:TOP_FUNCTIONS]


def child(args: argparse.Namespace) -> None:
    """One way under callgrind: a warm-up epoch uncounted, then one counted."""
    toggle = ctypes.CDLL(args.toggle).toggle_collect
    torch.set_num_threads(1)
    ways = Ways(args.root, args.batch, args.workdir)
    ways.run(args.child)
    toggle()
    images = ways.run(args.child)
    toggle()
    ways.data.close()
    print(json.dumps({"images": images}))


# ----------------------------------------------------------------------------- report
def table(result: dict) -> str:
    lines = ["| way (one core) | images/s (median; range) | x bare decode (median; range) | x bare, by the thread's "
             "CPU time |", "| --- | ---: | ---: | ---: |"]  # fmt: skip
    for way, row in result["summary"].items():
        rate, ratio, cpu = row["images_per_sec"], row["x_bare"], result["summary_cpu_time"][way]["x_bare"]
        lines.append(
            f"| {way} | {rate['median']:,.0f} ({rate['min']:,.0f}-{rate['max']:,.0f}) | {ratio['median']:.3f} "
            f"({ratio['min']:.3f}-{ratio['max']:.3f}) | {cpu['median']:.3f} ({cpu['min']:.3f}-{cpu['max']:.3f}) |"
        )
    stage = ", ".join(f"{k} {v:.3f}" for k, v in result["loader_stage_ms"].items())
    lines += ["", f"The loader's stages, ms per image (median over rounds): {stage}."]
    counted = result.get("instructions", {"note": "not measured"})
    if counted["note"] != "measured":
        return "\n".join([*lines, "", f"Instructions: {counted['note']}."])
    lines += ["", f"Instructions per image (callgrind, one epoch of {counted['files']} files):", ""]
    for way, row in counted["ways"].items():
        lines.append(f"- {way}: {row['per_image'] / 1e6:.2f} M (bare / this: {row['bare_over_this']:.3f}); top: "
                     + ", ".join(f"{name} {count / 1e6:.2f} M" for name, count in row["top"][:8]))  # fmt: skip
    return "\n".join(lines)


def section(workdir: Path, quick: bool, rounds: int) -> dict:
    """bench.py's `per-core` section: the quick smoke test's tiny folder, or the full measurement."""
    args = parser().parse_args(QUICK if quick else ["--rounds", str(rounds), "--instructions"])
    args.workdir = workdir / "per-core"
    return run(args)


def run(args: argparse.Namespace) -> dict:
    args.workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # one core: what a DataLoader worker has
    folder = make_folder(args.workdir, args.files)
    result = {"files": args.files, "size": list(SIZE), "batch": args.batch, "rounds": args.rounds}
    result |= measure(folder, args.batch, args.rounds, args.workdir / "run")
    result["summary"] = summary(result.pop("rates"))
    result["summary_cpu_time"] = summary(result.pop("cpu_rates"))
    result["instructions"] = {"note": "not measured: --instructions not given"}
    if args.instructions:
        result["instructions"] = instructions(subset(folder, args.instruction_files), args.batch, args.workdir)
    result["load_average_1min"] = os.getloadavg()[0]  # the machine's other work, if any, at the end
    result["table"] = table(result)
    return result


def render(report: dict) -> list[str]:
    """The section's markdown, when the report holds it."""
    if "per_core" not in report:
        return []
    result = report["per_core"]
    head = f"### The loader on one core against a bare decode ({result['files']} JPEGs 500x375, batches of "
    return ["", head + f"{result['batch']}, {result['rounds']} interleaved rounds)", "", result["table"], ""]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=512, help="distinct JPEGs, one epoch (default 512)")
    parser.add_argument("--batch", type=int, default=64, help="the loader's batch (data.batch_size's default)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--instructions", action="store_true", help="also count instructions under callgrind")
    parser.add_argument("--instruction-files", type=int, default=128, help="files of the counted epoch")
    parser.add_argument("--workdir", type=Path, default=None, help="where the files are made (kept between runs)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--toggle", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = parser().parse_args()
    if args.child:
        child(args)
        return
    args.workdir = args.workdir or Path(tempfile.gettempdir()) / "imgtrain-per-core"
    result = run(args)
    print(result["table"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
