"""A full disk under the run directory: one line naming the disk and its free space, never a traceback, on a real
tmpfs of 2 MiB (mounting one needs root: the tests skip elsewhere)."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import FAST, compose_cfg, run_train

from imgtrain.common.disk import disk_full_line, is_disk_full
from imgtrain.common.errors import RunError
from imgtrain.train.run import run

PAGE = 4096  # tmpfs counts whole pages: every small file takes one


@pytest.fixture
def disk(tmp_path: Path):
    """A 2 MiB tmpfs at tmp_path/disk, unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk: Path, pages_left: int) -> None:
    """Fill `disk` but `pages_left` pages."""
    left = shutil.disk_usage(disk).free - pages_left * PAGE
    with open(disk / "filler", "wb") as filler:
        filler.write(b"\0" * left)
    assert shutil.disk_usage(disk).free == pages_left * PAGE


def test_the_line_names_the_mount_its_device_and_its_free_space(disk: Path) -> None:
    _fill(disk, 2)
    line = disk_full_line(disk / "run" / "tb" / "events")  # not created yet: the disk it would be on
    assert line == f"No space left on device on {disk} (tmpfs, 8.0 KiB free of 2.0 MiB)", line
    with pytest.raises(OSError) as caught:
        (disk / "big").write_bytes(b"\0" * 3 * PAGE)
    assert is_disk_full(caught.value) and not is_disk_full(OSError(13, "Permission denied"))
    wrapped = RunError("the checkpoint could not be written")
    wrapped.__cause__ = caught.value
    assert is_disk_full(wrapped)  # a full disk under an error of ours


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_on_a_full_disk_is_one_line(disk: Path, data_dir: Path) -> None:
    """Room for the lock and loader_args.json, none for TensorBoard's events: 153 lines before, with the writer
    thread's own traceback (pytest's warning about that thread's exception fails the test)."""
    _fill(disk, 2)
    with pytest.raises(RunError) as caught:
        run(compose_cfg(*FAST, output_dir=str(disk / "run")))
    message = str(caught.value)
    assert message.startswith(f"TensorBoard could not write {disk / 'run' / 'tb'}: No space left on device on {disk}")
    assert "free of 2.0 MiB)" in message and "\n" not in message


FULL_RUNS = {  # pages left -> what fails first in `python train.py`, after the lock, .hydra/ and train.log
    6: "TensorBoard could not write {run}/tb: No space left on device",  # 153 lines before
    4: "{run}/loader_args.json could not be written: No space left on device",  # 167, most of them train.log's
}


@pytest.mark.slow  # a train.py process each: 5 s; the checkpoint on a full disk stays in make test
@pytest.mark.parametrize("pages", [6, 4])
def test_a_full_disk_and_the_failed_json_it_prevents_are_one_line(pages: int, disk: Path, data_dir: Path) -> None:
    """`python train.py` on a full disk: one line on stderr, failed.json's failure in it too; train.log, full as
    well, says so once on the console, not in a traceback per line logged."""
    _fill(disk, pages)
    run_dir = disk / "run"
    result = run_train([*FAST], run_dir, data_dir)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: " + FULL_RUNS[pages].format(run=run_dir)), errors[0]
    assert f"on {disk} (tmpfs, 0 bytes free of 2.0 MiB)" in errors[0]
    failed = run_dir / "failed.json"
    assert errors[0].endswith(f"; {failed} could not be written either (No space left on device)"), errors[0]
    full_log = f"{run_dir / 'train.log'} cannot be written: No space left on device on {disk}"
    assert (full_log in result.stdout) == (pages == 4) and result.stdout.count(full_log) <= 1


def test_a_checkpoint_on_a_full_disk_is_one_line_and_the_last_good_one_stays(disk: Path, tmp_path: Path) -> None:
    """torch.save on a full disk raises "unexpected pos N vs M" (its zip writer's check, the ENOSPC behind it): the
    line names the disk instead, and the previous last.pt is kept. TensorBoard's folder is a link of the run's own
    user to another disk, so the checkpoint is what meets the full one."""
    run_dir, events = disk / "run", tmp_path / "tb"
    tiny = ["model._target_=test_resume_settings.tiny_cnn", "dataset.num_val=16"]
    quick = [*FAST, *tiny, "data.num_workers=0", "metrics.compute_probe=false"]
    events.mkdir()
    run_dir.mkdir()
    (run_dir / "tb").symlink_to(events)
    run(compose_cfg(*quick, "train.max_steps=2", output_dir=str(run_dir)))
    last = run_dir / "checkpoints" / "last.pt"
    kept = last.read_bytes()
    (run_dir / "metrics.json").unlink()
    _fill(disk, 3)  # room for loader_args.json, not for a checkpoint (about 8 pages)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunError) as caught:
        run(compose_cfg(*quick, "train.max_steps=4", output_dir=str(run_dir)))
    assert signal.getsignal(signal.SIGTERM) is before  # kept while the run ended, given back when run() returned
    message = str(caught.value)
    assert message.startswith(f"could not write the checkpoint of step 4 to {last} (No space left on device on {disk}")
    assert "(tmpfs, " in message and "unexpected pos" not in message and "\n" not in message
    assert f"The last good checkpoint is {last}" in message and last.read_bytes() == kept
    assert not list(last.parent.glob(".*.tmp"))
