"""Any model by name: model=torchvision (any classification model of torchvision.models) and model=timm (the extra
imgtrain[timm]) train through the same loop; a bad name or option is one line; pretrained weights come from the
library's cache or a file, never from the network, with the head left at init for another number of classes."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import socket
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import compose_cfg
from shardhelpers import failure

from imgtrain.common.errors import ConfigError
from imgtrain.config.validate import validate
from imgtrain.host import optional
from imgtrain.train.model import build_timm, build_torchvision
from imgtrain.train.placement import check_model, parameters_text
from imgtrain.train.run import run

needs_timm = pytest.mark.skipif(optional.missing("timm"), reason="model=timm needs pip install -e '.[timm]'")

TINY = [
    "dataset=synthetic",
    "dataset.image_size=32",
    "dataset.num_train=64",
    "dataset.num_val=32",
    "data.batch_size=16",
    "data.num_workers=0",
    "metrics.skip_first_steps=1",
    "metrics.compute_probe=false",
    "train.max_steps=3",
    "system.channels_last=true",
]
# Small models that take 32-px images: torchvision's 0.35M-parameter ShuffleNet, and one of the models timm makes for
# its own tests (0.2M parameters).
TORCHVISION_SMALL = "shufflenet_v2_x0_5"
TIMM_SMALL = "test_convnext"


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No connection can be opened: a download would fail the test rather than pass on a machine with network."""

    def refuse(*args: object) -> None:
        raise AssertionError(f"a connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def _train(tmp_path: Path, *overrides: str) -> dict:
    run(compose_cfg(*TINY, *overrides, output_dir=str(tmp_path)))
    return json.loads((tmp_path / "metrics.json").read_text())


def test_a_torchvision_model_that_is_not_a_resnet_trains(tmp_path: Path) -> None:
    metrics = _train(tmp_path, "model=torchvision", f"model.arch={TORCHVISION_SMALL}")
    assert metrics["model"] == TORCHVISION_SMALL and metrics["steps"] == 3 and math.isfinite(metrics["val_loss"])


@needs_timm
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])  # bf16: 2x on CPU
def test_a_timm_model_trains(tmp_path: Path, precision: str) -> None:
    metrics = _train(tmp_path, "model=timm", f"model.name={TIMM_SMALL}", f"system.precision={precision}")
    assert metrics["model"] == TIMM_SMALL and metrics["steps"] == 3 and metrics["precision"] == precision
    assert math.isfinite(metrics["val_loss"])


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["model=torchvision", "model.arch=convnxt_tiny"],
            "is not a classification model of torchvision.models (close: convnext_tiny",
        ),
        (["model=torchvision", "model.arch=fasterrcnn_resnet50_fpn"], "is not a classification model"),
        (
            ["model=resnet18_cifar", "model.arch=mobilenet_v3_small"],
            "model.cifar_stem=true is for torchvision's ResNets",
        ),
        (["model=torchvision", "model.arch=vgg11", "model.zero_init_residual=true"], "model.zero_init_residual=true"),
        pytest.param(
            ["model=timm", "model.name=convnxt_atto"], "is not a timm model (close: convnext_atto", marks=needs_timm
        ),
        pytest.param(["model=timm", "model.name=resnet10t.nosuchtag"], "Invalid pretrained tag", marks=needs_timm),
    ],
    ids=["torchvision-typo", "torchvision-detection", "cifar-stem", "zero-init", "timm-typo", "timm-tag"],
)
def test_a_bad_name_or_option_is_one_line(overrides: list[str], line: str) -> None:
    settings = validate(compose_cfg(*overrides))
    with pytest.raises(ConfigError) as caught:
        check_model(settings.model)
    assert line in str(caught.value) and "\n" not in str(caught.value)


def test_a_bad_name_ends_the_run_in_one_line(tmp_path: Path) -> None:
    error = failure(*TINY, "model=torchvision", "model.arch=convnxt_tiny", run_dir=tmp_path)
    assert isinstance(error, ConfigError) and str(error).startswith("model.arch=convnxt_tiny is not")


def test_pretrained_from_a_file_leaves_the_head_at_init_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint of a 1000-class model (under "model", as imgtrain saves them, from a compiled module): every
    tensor but the classifier's is copied, and the log names those left."""
    source = build_torchvision(TORCHVISION_SMALL, num_classes=1000)
    path = tmp_path / "weights.pt"
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in source.state_dict().items()}, "step": 7}, path)
    with caplog.at_level(logging.INFO, logger="imgtrain.train.pretrained"):
        model = build_torchvision(TORCHVISION_SMALL, num_classes=10, pretrained=str(path))
    loaded, original = model.state_dict(), source.state_dict()
    assert torch.equal(loaded["conv1.0.weight"], original["conv1.0.weight"])
    assert loaded["fc.weight"].shape == (10, 1024)
    kept = len(original) - 2
    assert f"kept {kept} tensors; left fc.weight, fc.bias at init for 10 classes" in caplog.text
    with pytest.raises(ConfigError, match="cannot be read as weights") as caught:
        build_torchvision(TORCHVISION_SMALL, pretrained=__file__)
    assert "\n" not in str(caught.value)


class Planted:
    """A pickled object whose loading would create `marker` (open(marker, "w") through __reduce__): the code a
    crafted weights file could run, made harmless."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _genuine(
    torch_home: Path, monkeypatch: pytest.MonkeyPatch, arch: str, payload: object, zipped: bool = False, **save
) -> Path:
    """`payload` in the torch hub cache as torchvision names its files (`<name>-<its SHA-256 prefix>.pth`), and
    `arch`'s default weights pointed at that name: our configuration of which file is torchvision's (the real
    files cannot be fetched here), not the loader under test. `zipped`: the file alone in a zip archive, as some
    of torchvision's oldest files are (resnet18-5c106cde.pth)."""
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    staged = torch_home / "staged.pth"
    torch.save(payload, staged, **save)
    if zipped:
        with zipfile.ZipFile(torch_home / "staged.zip", "w") as archive:
            archive.write(staged, "weights.pth")
        staged = torch_home / "staged.zip"
    digest = hashlib.sha256(staged.read_bytes()).hexdigest()
    cached = torch_home / "hub" / "checkpoints" / f"{arch}-{digest[:10]}.pth"
    cached.parent.mkdir(parents=True, exist_ok=True)
    staged.rename(cached)
    monkeypatch.setattr(weights.value, "url", f"https://download.pytorch.org/models/{cached.name}")
    return cached


def test_pretrained_true_reads_the_torch_hub_cache_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Absent from the cache: one line naming the file looked for and how to fetch it. There, under a name whose
    SHA-256 prefix matches (TORCH_HOME moves the cache): read from it, the head left at init."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(ConfigError) as caught:
        build_torchvision(TORCHVISION_SMALL, pretrained=True)
    line = str(caught.value)
    cached = tmp_path / "hub" / "checkpoints" / "shufflenetv2_x0.5-f707e7126e.pth"
    assert "\n" not in line and f"looked for {cached}" in line and "weights='DEFAULT'" in line
    imagenet = build_torchvision(TORCHVISION_SMALL, num_classes=1000)
    cached = _genuine(tmp_path, monkeypatch, TORCHVISION_SMALL, imagenet.state_dict())
    with caplog.at_level(logging.INFO, logger="imgtrain.train.pretrained"):
        model = build_torchvision(TORCHVISION_SMALL, num_classes=10, pretrained=True)
    assert torch.equal(model.state_dict()["conv5.0.weight"], imagenet.state_dict()["conv5.0.weight"])
    assert "left fc.weight, fc.bias at init for 10 classes" in caplog.text and str(cached) in caplog.text


def test_pretrained_true_refuses_a_cached_file_that_does_not_match_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    """Weights of the right shapes, but not torchvision's file: the SHA-256 prefix in the name decides, as it
    does on a download (torch.hub checked it only then, so this file was loaded)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    cached = tmp_path / "hub" / "checkpoints" / "shufflenetv2_x0.5-f707e7126e.pth"
    cached.parent.mkdir(parents=True)
    torch.save(build_torchvision(TORCHVISION_SMALL, num_classes=1000).state_dict(), cached)
    with pytest.raises(ConfigError) as caught:
        build_torchvision(TORCHVISION_SMALL, num_classes=10, pretrained=True)
    line = str(caught.value)
    assert line.startswith(f"model.pretrained=true: {cached} is not torchvision's ShuffleNet_V2_X0_5_Weights.")
    assert "its name says f707e7126e (a damaged or foreign file, never read); delete it" in line and "\n" not in line


@pytest.mark.parametrize("named", ["torchvision's name", "its own hash"])
def test_a_crafted_file_in_the_torch_hub_cache_runs_no_code(
    named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    """The issue's file: a pickle that runs code, at torchvision's name (refused by its hash) or named after its
    own hash (read, with weights_only: refused, no code run). One line either way."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    marker, payload = tmp_path / "code-ran", {"conv1.0.weight": Planted(tmp_path / "code-ran")}
    if named == "its own hash":
        cached = _genuine(tmp_path, monkeypatch, TORCHVISION_SMALL, payload)
        said = "holds Python objects other than tensors and plain data (GLOBAL io.open), which are never loaded"
    else:
        cached = tmp_path / "hub" / "checkpoints" / "shufflenetv2_x0.5-f707e7126e.pth"
        cached.parent.mkdir(parents=True)
        torch.save(payload, cached)
        said = "(a damaged or foreign file, never read)"
    with pytest.raises(ConfigError) as caught:
        build_torchvision(TORCHVISION_SMALL, num_classes=10, pretrained=True)
    assert not marker.exists(), "loading the cached file ran its code"
    assert str(caught.value).startswith(f"model.pretrained=true: {cached} ") and said in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_crafted_weights_file_runs_no_code(tmp_path: Path) -> None:
    path, marker = tmp_path / "weights.pt", tmp_path / "code-ran"
    torch.save({"model": {"conv1.0.weight": Planted(marker)}}, path)
    with pytest.raises(ConfigError) as caught:
        build_torchvision(TORCHVISION_SMALL, num_classes=10, pretrained=str(path))
    line = str(caught.value)
    assert line.startswith(f"model.pretrained={path} cannot be read as weights (it holds Python objects other than")
    assert "(GLOBAL io.open)" in line and "\n" not in line and "\x1b" not in line and not marker.exists()


LEGACY = {"_use_new_zipfile_serialization": False}  # torch.save's format before torch 1.6: not a zip archive


@pytest.mark.parametrize(
    ("arch", "save", "older"),
    [
        ("densenet121", {}, True),
        (TORCHVISION_SMALL, LEGACY, False),
        (TORCHVISION_SMALL, {**LEGACY, "zipped": True}, False),
    ],
    ids=["densenet old key names", "pre-1.6 file format", "pre-1.6 file in a zip"],
)
def test_torchvisions_older_files_load_as_torchvision_loads_them(
    arch: str, save: dict, older: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    """What torchvision's loader does besides loading, kept: DenseNet's files name keys as older torch allowed
    ("denselayer1.norm.1.weight", and no BatchNorm step counts), renamed on loading; files written before torch
    1.6 are not zip archives, and the oldest are such a file alone in a zip (torch.hub unpacks it)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    imagenet = build_torchvision(arch, num_classes=1000).state_dict()
    old_names = re.compile(r"(denselayer\d+\.(?:norm|relu|conv))([12])\.")
    state = {old_names.sub(r"\1.\2.", key) if older else key: value for key, value in imagenet.items()}
    state = {key: value for key, value in state.items() if not (older and key.endswith("num_batches_tracked"))}
    assert not older or "features.denseblock1.denselayer1.norm.1.weight" in state
    _genuine(tmp_path, monkeypatch, arch, state, **save)
    model = build_torchvision(arch, num_classes=10, pretrained=True)
    shared = [key for key in imagenet if "classifier" not in key and not key.startswith("fc.")]
    assert all(torch.equal(model.state_dict()[key], imagenet[key]) for key in shared)


def test_a_torch_with_known_weights_only_bypasses_reads_no_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    _genuine(tmp_path, monkeypatch, TORCHVISION_SMALL, build_torchvision(TORCHVISION_SMALL).state_dict())
    torch.save(build_torchvision(TORCHVISION_SMALL).state_dict(), tmp_path / "weights.pt")
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    for pretrained in (True, str(tmp_path / "weights.pt")):
        with pytest.raises(ConfigError) as caught:
            build_torchvision(TORCHVISION_SMALL, pretrained=pretrained)
        line = str(caught.value)
        assert "torch 2.9.1+cu128 cannot read weights safely" in line and line.endswith("install torch>=2.10")


@needs_timm
def test_timm_pretrained_true_reads_the_hugging_face_cache_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The same for timm: its weights' repository in the Hugging Face cache (laid out as huggingface_hub does), or
    one line; a file path read by timm's reader (safetensors too)."""
    from huggingface_hub import constants  # noqa: PLC0415 - only where timm (which brings it) is installed
    from safetensors.torch import save_file  # noqa: PLC0415

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError) as caught:
        build_timm(TIMM_SMALL, pretrained=True)
    repo = tmp_path / "models--timm--test_convnext.r160_in1k"
    assert "\n" not in str(caught.value) and f"looked in {repo}" in str(caught.value)
    imagenet = build_timm(TIMM_SMALL, num_classes=1000)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    save_file(imagenet.state_dict(), repo / "snapshots" / "0123abcd" / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="imgtrain.train.pretrained"):
        model = build_timm(TIMM_SMALL, num_classes=10, pretrained=True)
        from_file = build_timm(
            TIMM_SMALL, num_classes=10, pretrained=str(repo / "snapshots/0123abcd/model.safetensors")
        )
    for built in (model, from_file):
        assert torch.equal(built.state_dict()["stem.0.weight"], imagenet.state_dict()["stem.0.weight"])
    assert caplog.text.count("left head.fc.weight, head.fc.bias at init for 10 classes") == 2


@needs_timm
def test_timm_pretrained_runs_no_code_from_a_crafted_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    """A pickle that runs code as the weights in timm's Hugging Face cache, or passed as a file: timm's reader
    (weights_only) refuses it, in one line."""
    from huggingface_hub import constants  # noqa: PLC0415 - only where timm (which brings it) is installed

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--timm--test_convnext.r160_in1k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    crafted, marker = repo / "snapshots" / "0123abcd" / "pytorch_model.bin", tmp_path / "code-ran"
    crafted.parent.mkdir(parents=True)
    torch.save({"stem.0.weight": Planted(marker)}, crafted)
    for pretrained, start in ((True, f"model.pretrained=true: {crafted} cannot be read ("),
                              (str(crafted), f"model.pretrained={crafted} cannot be read as weights (")):  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            build_timm(TIMM_SMALL, num_classes=10, pretrained=pretrained)
        assert str(caught.value).startswith(start) and "\n" not in str(caught.value)
    assert not marker.exists()


def test_a_missing_timm_is_one_line_with_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # what `import timm` does where it is not installed
    error = failure(*TINY, "model=timm", f"model.name={TIMM_SMALL}", run_dir=tmp_path)
    assert isinstance(error, optional.MissingEngine)
    assert str(error).startswith("model=timm needs timm, which cannot be imported here")
    assert "pip install -e '.[timm]'" in str(error)


def test_the_log_gives_a_models_parameters_to_3_significant_figures() -> None:
    """A 0.01M-parameter model read "0.0M" at one decimal."""
    said = [parameters_text(n) for n in (10, 12_345, 999_999, 11_689_512, 25_557_032, 1_234_567_890)]
    assert said == ["10", "12.3k", "1M", "11.7M", "25.6M", "1.23G"]
