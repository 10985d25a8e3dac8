"""Bad input on the command line: exit status 2, one line naming the key, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_train
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from imgtrain.cli import one_line


def test_one_line_keeps_key_and_reason() -> None:
    cause = ValidationError(
        "Value 'abc' of type 'str' could not be converted to Integer\n    full_key: data.batch_size"
    )
    error = ConfigCompositionException("Error merging override data.batch_size=abc")
    error.__cause__ = cause
    assert one_line(error) == (
        "Error merging override data.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer"
    )


def test_one_line_lists_group_options_without_schemas() -> None:
    error = ConfigCompositionException(
        "In 'config': Could not find 'dataset/bogus'\n\nAvailable options in 'dataset':\n\tbase_shapes\n\tcifar10\n"
        "\tshapes\nConfig search path:\n\tprovider=hydra, path=pkg://hydra.conf"
    )
    assert one_line(error) == (
        "In 'config': Could not find 'dataset/bogus': Available options in 'dataset': cifar10, shapes"
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.batch_size=abc", "data.batch_size=abc"),
        ("data.num_workers=-1", "data.num_workers=-1 is invalid: expected an integer >= 0 or auto"),
        ("data.prefetch_factor=0", "data.prefetch_factor=0 is invalid"),
        ("dataset=bogus", "cifar10, cifar100, imagefolder, shapes, synthetic"),
        ("data.no_such_key=1", "Key 'no_such_key' not in 'DataConfig'"),
        ("dataset=cifar10", "download failed (offline?). Download cifar-10-python.tar.gz"),
        ("dataset=imagefolder dataset.root=/no/such/dir", "dataset.root=/no/such/dir is not a directory"),
    ],
)
def test_bad_input_is_one_clear_line(override: str, expected: str, tmp_path: Path, data_dir: Path) -> None:
    result = run_train(override.split(), tmp_path / "run", data_dir, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert errors[0].count(expected) == 1  # said once, not repeated by a wrapping exception
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_full_error_env_keeps_the_traceback(tmp_path: Path, data_dir: Path) -> None:
    result = run_train(["data.num_workers=-1"], tmp_path / "run", data_dir, timeout=120, HYDRA_FULL_ERROR="1")
    assert result.returncode != 0 and "Traceback" in result.stderr
