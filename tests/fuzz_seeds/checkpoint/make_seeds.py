"""Writes the checkpoint seeds of tests/test_fuzz_checkpoint.py: `python tests/fuzz_seeds/checkpoint/make_seeds.py`
from the repository root. real.pt is a checkpoint of the small model test_checkpoint.py resumes (a convolution, a
BatchNorm, AdamW one step in); every other file is real.pt with one field or one byte pattern crafted, each a crash
or hang a reader had (the comment says which)."""

from __future__ import annotations

import io
import os
import sys
import zipfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: helpers, test_checkpoint

from test_checkpoint import _checkpointer  # noqa: E402

from imgtrain.resilience.checkpoint import write_verified  # noqa: E402


class Planted:
    """A pickled object that would run a command when loaded (weights_only refuses it)."""

    def __reduce__(self):
        return os.system, ("true",)


def shared_lists(levels: int = 9, width: int = 10) -> list:
    """One list holding the same list `width` times, at each of `levels` levels: a few hundred bytes as a pickle
    (memoized), width ** levels items to walk or print."""
    node: list = ["x"] * width
    for _ in range(levels):
        node = [node] * width
    return node


ALIAS_BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))
    + "train: {epochs: *i}\n"
)


def crafted(real: dict) -> dict[str, object]:
    """name -> payload (or raw bytes) of each crafted seed."""

    def edited(**progress) -> dict:
        return {**real, "progress": {**real["progress"], **progress}}

    return {
        "progress_epoch_1e12.pt": edited(epoch=10**12),  # the LR schedule replayed 10**12 epochs: days
        "progress_samples_1e12.pt": edited(samples_in_epoch=10**12),  # the same through the samples
        "progress_step_5000_digits.pt": edited(step=10**5000),  # pickled as LONG4, which weights_only refuses
        "progress_step_600_digits.pt": edited(step=10**600),  # loads (LONG1): beyond any run, said by its size
        "progress_val_shared_lists.pt": edited(val=shared_lists()),  # repr() of it in the message never ended
        "config_recursive_alias.pt": {**real, "config": "&a {x: *a}"},  # RecursionError flattening it
        "config_alias_bomb.pt": {**real, "config": ALIAS_BOMB},  # 10**9 values flattened: never ended
        "config_int_5000_digits.pt": {**real, "config": "train: {epochs: " + "1" * 5000 + "}"},  # ValueError
        "pickled_global.pt": {**real, "extra": Planted()},  # code in the pickle: refused, never run
        "version_string.pt": {**real, "version": "1"},
        "rng_gauss_tensor.pt": {**real, "rng": {**real["rng"], "numpy_gauss": (torch.tensor([]), 0.0)}},  # found:
        # `in (0, 1)` on an empty tensor raised RuntimeError
    }


def compressed(real: Path) -> bytes:
    """real.pt with a deflated entry of 64 MiB of zeros (64 KiB in the file): every entry unpacked to check its CRC
    made a small file cost its unpacked size."""
    out = io.BytesIO()
    with zipfile.ZipFile(real) as source, zipfile.ZipFile(out, "w") as target:
        for entry in source.infolist():
            target.writestr(entry, source.read(entry))
        prefix = source.namelist()[0].split("/")[0]
        padding = zipfile.ZipInfo(f"{prefix}/padding", date_time=(1980, 1, 1, 0, 0, 0))  # no clock: the same file
        target.writestr(padding, bytes(64 << 20), compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def name_not_utf8(real: Path) -> bytes:
    """real.pt with its first entry's local name flagged UTF-8 (general purpose bit 11) and not UTF-8: zipfile's
    check raised UnicodeDecodeError, which no reader caught (a target found it)."""
    data = bytearray(real.read_bytes())
    data[6] |= 0x08  # the flags' second byte: bit 11 of the little-endian word
    data[30] = 0x80  # the first byte of the name: no UTF-8 sequence starts with it
    return bytes(data)


def zip_version(real: Path) -> bytes:
    """real.pt with its first central-directory entry asking for zip version 25.3 to extract: zipfile opens no such
    archive and raises NotImplementedError, which no reader caught (Atheris found it in a few hundred inputs)."""
    data = bytearray(real.read_bytes())
    entry = data.index(b"PK\x01\x02")  # the central directory's first entry
    data[entry + 6 : entry + 8] = (253).to_bytes(2, "little")  # version needed to extract, in tenths
    return bytes(data)


def main() -> None:
    import random
    import tempfile

    import numpy as np

    random.seed(0)  # the same files on every run: the weights and the saved generator states
    np.random.seed(0)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        checkpointer = _checkpointer(Path(tmp))
        real = checkpointer._payload()
    write_verified(real, HERE / "real.pt")
    for name, payload in crafted(torch.load(HERE / "real.pt", weights_only=True)).items():
        torch.save(payload, HERE / name)
    (HERE / "compressed_entry.pt").write_bytes(compressed(HERE / "real.pt"))
    (HERE / "zip_name_not_utf8.pt").write_bytes(name_not_utf8(HERE / "real.pt"))
    (HERE / "zip_version_25_3.pt").write_bytes(zip_version(HERE / "real.pt"))


if __name__ == "__main__":
    main()
