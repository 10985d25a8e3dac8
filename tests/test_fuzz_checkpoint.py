"""Fuzz targets for checkpoints read back (resilience/checkpoint/: files.load, shape.check_shape and check_reach,
changes.changed_settings, the restore), seeded from fuzz_seeds/checkpoint/ (a real checkpoint of a small model, and
crafted ones: make_seeds.py writes them, each a crash or hang a reader had). The properties:
- any bytes as the file: `load` ends in the payload or in CheckpointError (one line), within the bound, reading
  at most the file's size (a compressed entry is refused before it is unpacked);
- any payload torch's weights_only loader accepts, each field edited (numbers no int holds, text, lists, mappings,
  tensors of other dtypes and shapes; lists shared at every level): resuming from it ends in the run's Progress or
  in one line naming the file (RunError, or ConfigError for a file that is not a checkpoint), within the bound;
- the real checkpoint resumes where it was written.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzzing import INTERESTING, JSON_VALUES, bounded, fast, mutated, seed_files, slow
from hypothesis import given
from hypothesis import strategies as st
from test_checkpoint import _checkpointer

from imgtrain.common.errors import ConfigError, RunError
from imgtrain.resilience.checkpoint import Checkpointer, CheckpointError, load

SEEDS = seed_files("checkpoint", "*.pt")
REAL = torch.load(Path(__file__).parent / "fuzz_seeds" / "checkpoint" / "real.pt", weights_only=True)
TENSORS = [
    torch.zeros(0),
    torch.zeros(3, dtype=torch.float16),
    torch.arange(6, dtype=torch.uint8),
    torch.ones(2, 2),
    torch.tensor(5),
    torch.zeros(1, 4, 3, 3),
]
LEAVES = st.one_of(JSON_VALUES, st.sampled_from(INTERESTING), st.sampled_from(TENSORS), st.just([[0] * 4] * 4))


def load_target(folder: Path, data: bytes) -> None:
    path = folder / "fuzzed.pt"
    path.write_bytes(data)
    try:
        with bounded("loading a checkpoint"):
            payload = load(path)
    except CheckpointError as error:
        assert "\n" not in str(error), error
        return
    assert isinstance(payload, dict)


@st.composite
def edited_payloads(draw: st.DrawFn) -> dict[str, Any]:
    """The real payload with up to 4 edits, each at a path drawn through its mappings, lists and tuples: a value
    replaced by one of LEAVES (a number by an interesting one, half the time), a key or item deleted, a key added."""
    payload = copy.deepcopy(REAL)
    for _ in range(draw(st.integers(1, 4))):
        payload = _edit(draw, payload, root=True)
    return payload


def _edit(draw: st.DrawFn, node: Any, root: bool = False) -> Any:
    """`node` with one edit at or below it (below it, for the payload itself)."""
    if isinstance(node, (int, float)) and not isinstance(node, bool) and draw(st.booleans()):
        return draw(st.sampled_from(INTERESTING))
    if not isinstance(node, (dict, list, tuple)) or not node or (not root and draw(st.integers(0, 3)) == 0):
        return draw(LEAVES)
    items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
    # the fields `load` reads first, edited one time in ten: else nine edits in ten stop there (Hypothesis draws
    # the first choices more often)
    first = 2 if root and draw(st.integers(0, 9)) else 0
    at = draw(st.integers(first, len(items) - 1))
    key, value = items[at]
    if draw(st.integers(0, 6)) == 0:  # deleted
        del items[at]
    else:
        items[at] = (key, _edit(draw, value))
    if isinstance(node, dict):
        edited = dict(items)
        if draw(st.integers(0, 8)) == 0:
            edited[draw(st.text(max_size=8))] = draw(LEAVES)
        return edited
    return type(node)(value for _, value in items)


_CHECKPOINTERS: dict[Path, Checkpointer] = {}


def resume_target(folder: Path, payload: dict[str, Any]) -> None:
    """`payload` saved as a file, and resumed from: the Progress, or one line naming the file."""
    if folder not in _CHECKPOINTERS:  # one per test (Hydra's compose takes a while); each resume replaces its state
        _CHECKPOINTERS[folder] = _checkpointer(folder)
    checkpointer = _CHECKPOINTERS[folder]
    path = folder / "edited.pt"
    torch.save(payload, path)
    checkpointer.settings.checkpoint.resume = str(path)
    try:
        with bounded("resuming"):
            progress = checkpointer.resume()
    except (RunError, ConfigError) as error:
        assert "\n" not in str(error) and str(path) in str(error), error
        return
    assert progress.epoch <= checkpointer.settings.train.epochs


@fast()
@given(mutated(list(SEEDS.values())))
def test_any_bytes_as_a_checkpoint_load_or_are_one_line(tmp_path: Path, data: bytes) -> None:
    load_target(tmp_path, data)


@fast()
@given(edited_payloads())
def test_any_payload_resumes_or_is_one_line(tmp_path: Path, payload: dict[str, Any]) -> None:
    resume_target(tmp_path, payload)


EXPECTED = {  # each seed: what resuming from it says (None: it resumes)
    "real.pt": None,
    "config_recursive_alias.pt": None,  # resumes; the log says the checkpoint's settings could not be read
    "config_alias_bomb.pt": None,
    "config_int_5000_digits.pt": None,
    "progress_epoch_1e12.pt": "its field progress.epoch is 1000000000000, past this run's",
    "progress_samples_1e12.pt": "its field progress.samples_in_epoch is 1000000000000, more than one epoch",
    "progress_step_5000_digits.pt": "holds Python objects other than tensors and plain data, which are never loaded "
    "(Unsupported operand 139)",  # LONG4: an integer of more than 255 bytes
    "progress_step_600_digits.pt": "its field progress.step is an integer of 1994 bits, more optimizer steps",
    "progress_val_shared_lists.pt": "its field progress.val is [[[[...], [...], [...], [...], ...], [[.... (a list)",
    "pickled_global.pt": "holds Python objects other than tensors and plain data",
    "version_string.pt": "its version is '1', not a format number",
    "rng_gauss_tensor.pt": "its field rng.numpy_gauss is (tensor([]), 0.0) (a tuple)",
    # found by Atheris (make test-slow): an entry's name holding a line break made the CRC line two lines
    "crc_mismatch_name_with_line_break.pt": "CRC mismatch in 'stent_workers: true\\n  i'",
    "compressed_entry.pt": "is compressed, which torch.save never does: not unpacked",
    "zip_name_not_utf8.pt": "cannot be used: 'utf-8' codec can't decode byte 0x80",
    "zip_version_25_3.pt": "cannot be used: zip file version 25.3",
}


@pytest.fixture(scope="module")
def checkpointer(tmp_path_factory: pytest.TempPathFactory) -> Checkpointer:
    """One for every seed (composing the config takes a while): each resume replaces what the last one restored."""
    return _checkpointer(tmp_path_factory.mktemp("seeds"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_seed_resumes_or_is_the_line_it_should_be(checkpointer: Checkpointer, tmp_path: Path, name: str) -> None:
    checkpointer.settings.checkpoint.resume = str(Path(__file__).parent / "fuzz_seeds" / "checkpoint" / name)
    load_target(tmp_path, SEEDS[name])
    with bounded(f"resuming from {name}"):
        if EXPECTED[name] is None:
            assert checkpointer.resume().step == REAL["progress"]["step"]
            return
        with pytest.raises((RunError, ConfigError)) as caught:
            checkpointer.resume()
    assert "\n" not in str(caught.value) and EXPECTED[name] in str(caught.value), caught.value


@pytest.mark.slow  # a few minutes: each target on SLOW examples
def test_the_checkpoint_targets_on_a_larger_budget(tmp_path: Path) -> None:
    slow()(given(mutated(list(SEEDS.values())))(lambda data: load_target(tmp_path, data)))()
    slow()(given(edited_payloads())(lambda payload: resume_target(tmp_path, payload)))()
