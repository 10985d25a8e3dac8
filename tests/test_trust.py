"""What others can put in front of a run (issue 30): a checkpoint from elsewhere, the bytes a peer sends through the
rendezvous, a damaged checkpoint or job file. None of it runs code, and each ends in one line or one marked row."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed.distributed_c10d as c10d
from bounded import within
from helpers import FAST, compose_cfg

from imgtrain.common.errors import ConfigError, RunError
from imgtrain.host import dist
from imgtrain.resilience.checkpoint import files
from imgtrain.sweep.report import collect, read_job
from imgtrain.train.run import run

QUICK = [*FAST, "dataset.num_val=32", "data.num_workers=0", "train.max_steps=2"]


class Planted:
    """A pickled object that would run a command when loaded (os.system through __reduce__)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real last.pt of a short debug=fast run (no worker process: seconds matter here)."""
    run_dir = tmp_path_factory.mktemp("trusted")
    run(compose_cfg(*QUICK, output_dir=str(run_dir)))
    return run_dir / "checkpoints" / "last.pt"


def _resume_from(payload: dict, path: Path, run_dir: Path) -> None:
    torch.save(payload, path)
    run(compose_cfg(*QUICK, f"checkpoint.resume={path}", output_dir=str(run_dir)))


def test_a_checkpoint_carrying_a_pickled_object_is_refused_in_one_line(checkpoint: Path, tmp_path: Path) -> None:
    marker = tmp_path / "planted-ran"
    payload = torch.load(checkpoint, weights_only=True)
    payload["extra"] = Planted(marker)
    with pytest.raises(ConfigError) as caught:
        _resume_from(payload, tmp_path / "planted.pt", tmp_path / "run")
    line = str(caught.value)
    assert "\n" not in line and "holds Python objects other than tensors and plain data" in line
    assert "posix.system" in line and not marker.exists()


def test_a_torch_with_known_weights_only_bypasses_loads_no_checkpoint(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    with pytest.raises(files.CheckpointError, match=r"torch 2.9.1\+cu128 cannot load it safely.*install torch>=2.10"):
        files.load(checkpoint)


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda p: p["progress"].update(bogus=1), "its field progress.bogus is not a field imgtrain saves"),
        (lambda p: p.pop("rng"), "its field rng is missing"),
        (lambda p: p.update(global_batch="many"), "its field global_batch is 'many' (a str), expected a whole number"),
        (lambda p: p.update(model=[1, 2]), "its field model is [1, 2] (a list), expected a state_dict"),
        (lambda p: p.update(optimizer="x"), "its field optimizer is 'x' (a str), expected an optimizer's state_dict"),
        (lambda p: p["progress"].update(step="5"), "its field progress.step is '5' (a str), expected a whole number"),
        (lambda p: p["model"].update({"0.weight": "w"}), "its field model.0.weight is 'w' (a str), expected a tensor"),
        (lambda p: p["optimizer"]["param_groups"].append(3), "its field optimizer.param_groups[2] is 3 (an int)"),
        (lambda p: p["progress"].update(val=[1]), "its field progress.val is [1] (a list), expected a mapping"),
        # loaded as it was into GradScaler, which multiplies by it from the first fp16 step on
        (lambda p: p.update(scaler={"scale": "x"}), "its field scaler is {'scale': 'x'} (a dict), expected GradScaler"),
        (lambda p: p["rng"].update(numpy_gauss=(1, float("inf"))), "its field rng.numpy_gauss is (1, inf) (a tuple)"),
    ],
    ids=[
        *("unknown progress key", "no rng", "global batch", "model", "optimizer", "step", "a weight", "group", "val"),
        *("scaler", "numpy gauss"),
    ],
)
def test_a_checkpoint_of_another_shape_is_one_line_naming_the_field(
    checkpoint: Path, tmp_path: Path, damage, said: str
) -> None:
    payload = torch.load(checkpoint, weights_only=True)
    damage(payload)
    with pytest.raises(RunError) as caught:
        _resume_from(payload, tmp_path / "edited.pt", tmp_path / "run")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"the checkpoint {tmp_path / 'edited.pt'} is not one imgtrain can")
    assert said in line


@pytest.mark.parametrize("version", ["1", None, True, 0])
def test_a_checkpoint_whose_version_is_not_a_number_is_one_line(checkpoint: Path, tmp_path: Path, version) -> None:
    payload = torch.load(checkpoint, weights_only=True)
    payload["version"] = version
    with pytest.raises(ConfigError) as caught:
        _resume_from(payload, tmp_path / "edited.pt", tmp_path / "run")
    line = str(caught.value)
    assert "\n" not in line and f"its version is {version!r}, not a format number (imgtrain writes 1)" in line


def test_a_checkpoint_schedule_of_any_shape_is_not_read(checkpoint: Path, tmp_path: Path) -> None:
    """The LR schedule follows the run's config (positioned by the samples seen): the saved one is never used."""
    payload = torch.load(checkpoint, weights_only=True)
    payload["scheduler"] = [1]
    _resume_from(payload, tmp_path / "edited.pt", tmp_path / "run")  # train.max_steps=2 again: trains 0 more steps
    assert (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.parametrize(
    ("field", "said"),
    [
        ("epoch", "past this run's 1 epoch(s) (train.epochs=1)"),
        ("samples_in_epoch", "more than one epoch of this run's data holds (at most 352)"),
        ("step", "more optimizer steps than the samples of 0 epoch(s) and 64 more (at most 64)"),
    ],
)
def test_stored_progress_this_run_cannot_reach_is_one_line_at_once(
    checkpoint: Path, tmp_path: Path, field: str, said: str
) -> None:
    """A huge epoch or sample count positioned the LR schedule by replaying it, about 2.5 us a step: days for 10**12.
    (8 steps of 32 an epoch here: one epoch holds fewer than (8 + 2) x 32 + the checkpoint's batch, 32.)"""
    payload = torch.load(checkpoint, weights_only=True)
    payload["progress"][field] = 10**12
    with within(30, "resuming"), pytest.raises(RunError) as caught:
        _resume_from(payload, tmp_path / "edited.pt", tmp_path / "run")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"the checkpoint {tmp_path / 'edited.pt'} holds progress this run")
    assert f"its field progress.{field} is 1000000000000, {said}" in line


def test_the_schedule_is_positioned_within_this_runs_own_steps(checkpoint: Path, tmp_path: Path) -> None:
    """An epoch this run allows, far past the steps it takes (train.max_steps=2): positioning the LR schedule
    costs at most this run's own steps, not the 80 million the stored epoch stands for."""
    payload = torch.load(checkpoint, weights_only=True)
    payload["progress"].update(epoch=10**7, samples_in_epoch=0)
    torch.save(payload, tmp_path / "far.pt")
    resume = f"checkpoint.resume={tmp_path / 'far.pt'}"
    with within(30, "resuming"):
        run(compose_cfg(*QUICK, "train.epochs=10000000", resume, output_dir=str(tmp_path / "run")))
    assert (tmp_path / "run" / "metrics.json").exists()


def test_the_collectives_carry_json_never_a_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-process gloo group: torch's object collectives (pickle both ways) are never reached, plain data goes
    through as JSON, and anything else is refused before it is sent."""

    def refuse(*args, **kwargs):
        raise AssertionError("a pickle crossed the process group")

    monkeypatch.setattr(c10d, "_object_to_tensor", refuse)
    monkeypatch.setattr(c10d, "_tensor_to_object", refuse)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    info = dist.DistInfo(launched=True)
    dist.setup(info, torch.device("cpu"), timeout_s=30)
    try:
        assert dist.broadcast_plain(("error", "a line"), info) == ["error", "a line"]
        assert dist.all_gather_plain({"/data/a.jpg": "truncated JPEG"}) == [{"/data/a.jpg": "truncated JPEG"}]
        with pytest.raises(TypeError, match="not JSON serializable"):
            dist.broadcast_plain(RunError("an exception object"), info)
    finally:
        dist.teardown()


def test_one_damaged_job_file_marks_its_row_and_the_report_goes_on(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for job, metrics, failed in [
        ("0", "{not json", None),
        ("1", None, "[1, 2]"),
        ("2", '{"images_per_sec": 5.0}', None),
    ]:
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- data.num_workers={job}\n")
        if metrics is not None:
            (sweep / job / "metrics.json").write_text(metrics)
        if failed is not None:
            (sweep / job / "failed.json").write_text(failed)
    rows, swept = collect(sweep)
    assert swept == ["data.num_workers"] and [row["status"] for row in rows] == ["damaged", "failed", "ok"]
    assert rows[0]["reason"].startswith("metrics.json cannot be read (not valid JSON: Expecting property name")
    assert rows[1]["reason"] == "failed.json does not hold a JSON object"
    assert read_job(sweep / "2")["images_per_sec"] == 5.0
    assert json.loads((sweep / "2" / "metrics.json").read_text())  # the report only reads
