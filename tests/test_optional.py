"""The optional engines (imgtrain/host/optional.py) and the CPU decoder's choice (data/decoders.py): one line naming the
package and the fix where one is missing, and no other run touched. Missing packages are made missing the way
Python itself does it (`sys.modules[name] = None` makes `import name` raise ImportError); the GPU box as a whole,
with the packages absent from disk, is tests/test_gpubox.py."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg
from PIL import Image
from shardhelpers import failure

from imgtrain.common.errors import ConfigError
from imgtrain.data import decoders
from imgtrain.data.shapes import ensure_shapes
from imgtrain.host import optional
from imgtrain.train.run import run


def test_every_engine_is_declared_in_its_extra() -> None:
    """The extra a MissingEngine line tells the user to install exists in pyproject.toml (as installed: the
    package's metadata) and holds the package, which is not also a core dependency."""
    requires = importlib.metadata.requires("imgtrain") or []
    for engine in optional.ENGINES.values():
        assert any(r.startswith(engine.package) and f'extra == "{engine.extra}"' in r for r in requires), engine
        assert not any(r.startswith(engine.package) and "extra ==" not in r for r in requires), engine


def test_a_missing_engine_is_one_line_naming_the_package_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "litdata", None)
    with pytest.raises(optional.MissingEngine) as caught:
        optional.require_extra("shards", "dataset=shards")
    line = str(caught.value)
    assert "\n" not in line and line.startswith("dataset=shards needs litdata, which cannot be imported here")
    assert "pip install -e '.[shards]'" in line
    assert optional.missing("litdata") and not optional.missing("json")


def test_a_run_on_shards_without_litdata_ends_before_touching_the_data(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "litdata", None)
    with pytest.raises(optional.MissingEngine, match=r"dataset=shards needs litdata"):
        run(compose_cfg("dataset=shards", f"dataset.root={tmp_path}", output_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run" / "checkpoints").exists()


# ----------------------------------------------------------------------------- the CPU decoder
@pytest.fixture
def no_torchcodec(monkeypatch: pytest.MonkeyPatch) -> None:
    """TorchCodec cannot be imported, and no decoder is chosen yet in this process."""
    monkeypatch.setitem(sys.modules, "torchcodec", None)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    monkeypatch.setattr(decoders, "_chosen", None)


def test_without_torchcodec_on_a_torchvision_that_deprecates_its_decoders_a_run_ends_in_one_line(
    no_torchcodec: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(decoders, "torchvision_version", lambda: (0, 29))
    error = failure("debug=fast", run_dir=tmp_path)  # the RunError inside Hydra's instantiate error
    line = str(error)
    assert isinstance(error, ConfigError)
    assert "\n" not in line and line.startswith("dataset=shapes needs TorchCodec, which cannot be imported here")
    assert "pip install 'torchcodec>=0.16' built for torch" in line and line.endswith("or use dataset=synthetic")


def test_a_synthetic_run_needs_no_decoder(no_torchcodec: None, tmp_path: Path) -> None:
    run(compose_cfg("debug=fast", "dataset=synthetic", output_dir=str(tmp_path)))
    assert decoders._chosen is None  # nothing decoded, nothing chosen


def test_before_torchvision_0_29_its_own_decoders_stand_in_and_the_log_says_so(
    no_torchcodec: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The GPU box's torchvision 0.26 with a TorchCodec that does not load: torchvision.io decodes JPEG and PNG as
    TorchCodec does (the same libjpeg-turbo algorithm: within a level), PIL the formats it does not read."""
    monkeypatch.setattr(decoders, "torchvision_version", lambda: (0, 26))
    with caplog.at_level(logging.WARNING, logger="imgtrain.data.decoders"):
        chosen = decoders.check("dataset=shapes")
        decoders.check("dataset=shapes")
    assert chosen.name.startswith("torchvision.io") and "torchcodec" in chosen.fallback_reason
    assert [r.getMessage() for r in caplog.records] == [
        f"dataset=shapes decodes images with {chosen.name}: TorchCodec cannot be imported here "
        f"({chosen.fallback_reason})"
    ]  # once
    root = Path(ensure_shapes(str(tmp_path), 48, 4, 1, 0))
    jpeg = next((root / "train").rglob("*.jpg"))
    monkeypatch.setattr(decoders, "_chosen", None)
    monkeypatch.delitem(sys.modules, "torchcodec")
    monkeypatch.delitem(sys.modules, "torchcodec.decoders")
    reference = decoders.decode_file(str(jpeg))  # TorchCodec
    bmp = tmp_path / "image.bmp"
    Image.fromarray(reference.permute(1, 2, 0).numpy()).save(bmp)
    monkeypatch.setattr(decoders, "_chosen", chosen)
    with warnings.catch_warnings():  # this machine's torchvision (0.29+) deprecates what 0.26 does not
        warnings.simplefilter("ignore", DeprecationWarning)
        fallback = decoders.decode_file(str(jpeg))
        with pytest.raises(ValueError, match="not a format torchvision.io decodes"):
            chosen.decode(decoders.read_file(str(bmp)))
        from_bmp = decoders.decode_file(str(bmp))  # PIL
    assert fallback.shape == reference.shape and fallback.dtype == torch.uint8
    assert (fallback.int() - reference.int()).abs().float().mean() < 1.0
    assert torch.equal(from_bmp, reference)
