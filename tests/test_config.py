"""Config composition for every option of every group, and validation of bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CONF_DIR, ROOT, compose_cfg
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from imgtrain.common.errors import ConfigError
from imgtrain.config import data as data_config
from imgtrain.config.checkpoint import CheckpointConfig
from imgtrain.config.data import DataConfig
from imgtrain.config.datasets import (
    CifarConfig,
    CsvConfig,
    CustomConfig,
    ImageFolderConfig,
    ShapesConfig,
    ShardsConfig,
    SyntheticConfig,
)
from imgtrain.config.faults import FaultsConfig
from imgtrain.config.loss import CrossEntropyConfig, FocalLossConfig
from imgtrain.config.metrics import MetricsConfig
from imgtrain.config.model import TimmModelConfig, TorchvisionModelConfig
from imgtrain.config.optim import AdamWConfig, SGDConfig
from imgtrain.config.renamed_keys import MOVED_KEYS
from imgtrain.config.schedule import StepDecayConfig, WarmupCosineConfig
from imgtrain.config.schema import Config
from imgtrain.config.system import SystemConfig
from imgtrain.config.train import TrainConfig
from imgtrain.config.validate import validate
from imgtrain.data.batched import spec_of
from imgtrain.data.datasets import imagenet_transforms
from imgtrain.train import run as run_module
from imgtrain.train.cli import one_line
from imgtrain.train.run import run

# The groups a user picks from. debug_dataset is picked by config.yaml from debug and dataset (tested below).
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "debug_dataset")
OPTIONS = [(group, path.stem) for group in GROUPS for path in sorted((CONF_DIR / group).glob("*.yaml"))]
SCHEMAS = {
    "shapes": ShapesConfig,
    "synthetic": SyntheticConfig,
    "imagefolder": ImageFolderConfig,
    "cifar10": CifarConfig,
    "cifar100": CifarConfig,
    "shards": ShardsConfig,
    "sgd": SGDConfig,
    "adamw": AdamWConfig,
}


def test_every_group_has_options() -> None:
    assert set(GROUPS) >= {
        "data",
        "dataset",
        "model",
        "optim",
        "train",
        "system",
        "checkpoint",
        "metrics",
        "faults",
        "debug",
    }
    assert len(OPTIONS) >= 16


def _dataset_args(option: str, tmp_path: Path) -> list[str]:
    """What a dataset (or an experiment on one) needs before it validates: a folder, a CSV per split, a class."""
    if option in ("imagefolder", "shards", "imagenet_resnet50", "imagenet_resnet50_tv"):
        return [f"dataset.root={tmp_path}"]
    if option == "csv":
        for split in ("train", "val"):
            (tmp_path / f"{split}.csv").write_text("path,label\na.png,cat\n")
        return [f"dataset.train={tmp_path / 'train.csv'}", f"dataset.val={tmp_path / 'val.csv'}"]
    if option == "custom":
        return ["dataset._target_=torchvision.datasets.FakeData"]
    return []


@pytest.mark.parametrize(("group", "option"), OPTIONS)
def test_every_option_composes_and_validates(group: str, option: str, tmp_path: Path) -> None:
    extra = _dataset_args(option, tmp_path)
    extra += ["model.name=resnet10t"] if (group, option) == ("model", "timm") else []  # no default name
    settings = validate(compose_cfg(f"{group}={option}", *extra))
    if group == "hparams_search":
        assert settings.optimized_metric == "images_per_sec" and settings.train.max_steps
        return
    if group == "debug":
        assert settings.dataset.num_train == 256 and settings.train.epochs == 1
        return
    if group == "experiment":
        return  # test_experiments_are_the_documented_recipes
    node = getattr(settings, group)
    if option in SCHEMAS:
        assert type(node) is SCHEMAS[option]
    if group == "dataset":
        assert node.name == option
    if group == "model" and option == "timm":
        assert type(node) is TimmModelConfig and node.name == "resnet10t"
    elif group == "model":
        assert type(node) is TorchvisionModelConfig
        assert node.arch == {"torchvision": "resnet18"}.get(option, option.removesuffix("_cifar"))
        assert node.cifar_stem == option.endswith("_cifar")


def test_defaults() -> None:
    cfg = compose_cfg()
    assert cfg.dataset.name == "shapes"
    assert cfg.model.arch == "resnet18"
    assert cfg.data.num_workers == "auto"
    assert cfg.system.device == "auto"
    assert OmegaConf.select(cfg, "data.distributed_sampler") == "auto"


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("data.batch_size=64", "batch_size", 64),
        ("data.num_workers=3", "num_workers", 3),
        ("data.pin_memory=false", "pin_memory", False),
        ("data.prefetch_factor=4", "prefetch_factor", 4),
        ("data.prefetch_factor=null", "prefetch_factor", None),
        ("data.persistent_workers=false", "persistent_workers", False),
        ("data.drop_last=false", "drop_last", False),
        ("data.shuffle=false", "shuffle", False),
        ("data.distributed_sampler=true", "distributed_sampler", True),
        ("data.multiprocessing_context=spawn", "multiprocessing_context", "spawn"),
        ("data.timeout=30", "timeout", 30.0),
        ("data.seed_workers=false", "seed_workers", False),
        ("data.in_order=false", "in_order", False),
    ],
)
def test_every_data_key_is_overridable(override: str, key: str, expected: object) -> None:
    settings = validate(compose_cfg(override))
    assert getattr(settings.data, key) == expected
    assert isinstance(getattr(settings.data, key), type(expected))  # a StartMethod is a str too


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.num_workers=-1", "data.num_workers=-1"),
        ("data.num_workers=lots", "data.num_workers=lots"),
        ("data.batch_size=0", "data.batch_size=0"),
        ("data.prefetch_factor=0", "data.prefetch_factor=0"),
        ("data.timeout=-1", "data.timeout=-1"),
        ("data.distributed_sampler=maybe", "auto, true, false"),
        ("train.epochs=0", "train.epochs=0"),
        ("checkpoint.every_min=0", "checkpoint.every_min=0.0 is invalid: expected minutes > 0, or null"),
        ("checkpoint.every_n_steps=-5", "checkpoint.every_n_steps=-5"),
        ("metrics.profile_steps=0", "metrics.profile_steps=0 is invalid: expected an integer >= 1 (steps recorded)"),
        ("dataset=imagefolder", "dataset.root is required"),
        ("optimized_metric=speed", "optimized_metric=speed is invalid: expected one of val_acc, val_acc5, val_loss"),
        ("train.ema_decay=1.5", "train.ema_decay=1.5 is invalid: expected null or (0, 1)"),
        ("checkpoint.best_of=ema", "checkpoint.best_of=ema needs an EMA to follow: set train.ema_decay"),
        ("optim._target_=torch.optim.Nope", "optim._target_=torch.optim.Nope is not a torch.optim optimizer"),
        ("optim._target_=torch.nn.Linear", "optim._target_=torch.nn.Linear is not a torch.optim optimizer"),
        ("optim=sgd optim._target_=torch.optim.RMSprop", "optim.nesterov is not an argument of torch.optim.RMSprop"),
        ("loss._target_=no.such.Loss", "loss._target_=no.such.Loss does not import"),
        ("schedule._target_=no.such.schedule", "schedule._target_=no.such.schedule does not import"),
        ("model._target_=no.such.build", "model._target_=no.such.build does not import"),
        ("optim=sgd +optim.foo=1", "optim.foo is not an argument of torch.optim.SGD"),
        ("dataset=imagefolder dataset.root=/no/such/dir", "/no/such/dir"),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(*override.split()))
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_in_order_false_needs_a_dataloader_that_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch < 2.6: DataLoader has no in_order argument, so data.in_order=false is refused before the run starts."""

    class OldDataLoader:  # torch 2.5's signature, in the part that matters here
        def __init__(self, dataset: object, batch_size: int = 1, num_workers: int = 0) -> None: ...

    monkeypatch.setattr(data_config, "DataLoader", OldDataLoader)
    assert validate(compose_cfg()).data.in_order is True  # the default asks nothing of torch
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg("data.in_order=false"))
    assert str(info.value) == "data.in_order=false is invalid: needs torch >= 2.6"


def test_split_fraction_outside_unit_interval(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dataset.val_fraction=1.5"):
        validate(compose_cfg("dataset=imagefolder", f"dataset.root={tmp_path}", "dataset.val_fraction=1.5"))


@pytest.mark.parametrize(
    "override", ["data.batch_size=abc", "data.no_such_key=1", "dataset=bogus", "data.in_order=maybe"]
)
def test_type_and_key_errors_fail_at_composition(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        compose_cfg(override)


@pytest.mark.parametrize(
    ("override", "options"),
    [
        ("data.multiprocessing_context=threads", "[fork, spawn, forkserver]"),
        ("system.device=tpu", "[auto, cpu, cuda]"),
        ("system.precision=fp8", "[auto, fp32, bf16, fp16]"),
        ("faults.nonfinite=ignore", "[stop, skip]"),
        ("mode=fast", "[train, loader, compute]"),
        ("dataset=imagefolder dataset.decode=gpu", "[cpu, cuda]"),
    ],
)
def test_choices_are_enums_checked_at_composition(override: str, options: str) -> None:
    """OmegaConf rejects a choice that is not an option, and the one line names the key and the options."""
    with pytest.raises(ConfigCompositionException) as caught:
        compose_cfg(*override.split())
    text = one_line(caught.value)
    assert override.split()[-1] in text and options in text and "\n" not in text


def _schema_defaults(schema: type) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)


@pytest.mark.parametrize(
    ("folder", "schema"),
    [
        ("data", DataConfig),
        ("train", TrainConfig),
        ("system", SystemConfig),
        ("checkpoint", CheckpointConfig),
        ("metrics", MetricsConfig),
        ("faults", FaultsConfig),
        ("model", TorchvisionModelConfig),
        ("optim", None),
        ("loss", None),
        ("schedule", None),
        ("dataset", None),
    ],
)
def test_every_default_is_set_in_one_place(folder: str, schema: type | None) -> None:
    """The YAML files choose a schema and set only what differs from its defaults."""
    schemas = {"sgd": SGDConfig, "adamw": AdamWConfig, "cifar10": CifarConfig, "cifar100": CifarConfig}
    schemas |= {"shapes": ShapesConfig, "synthetic": SyntheticConfig, "imagefolder": ImageFolderConfig}
    schemas |= {"shards": ShardsConfig, "csv": CsvConfig, "custom": CustomConfig}
    schemas |= {"ce": CrossEntropyConfig, "focal": FocalLossConfig, "warmup_cosine": WarmupCosineConfig}
    schemas |= {"step": StepDecayConfig}
    for path in sorted((CONF_DIR / folder).glob("*.yaml")):
        values = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items() if k != "defaults"}
        defaults = _schema_defaults(schema or schemas[path.stem])
        repeated = {k: v for k, v in values.items() if defaults.get(k) == v}
        assert not repeated, f"{path.name} repeats schema defaults: {repeated}"


def test_experiments_are_the_documented_recipes(tmp_path: Path) -> None:
    cifar = validate(compose_cfg("experiment=cifar10_resnet18"))
    assert (cifar.dataset.name, cifar.model.cifar_stem, type(cifar.optim)) == ("cifar10", True, SGDConfig)
    assert (cifar.data.batch_size, cifar.optim.lr, cifar.train.epochs) == (128, 0.1, 30)
    resident = validate(compose_cfg("experiment=cifar10_resident"))
    assert resident.data.device_resident and resident.optim.lr == 0.4 and resident.data.batch_size == 512
    imagenet = validate(compose_cfg("experiment=imagenet_resnet50", f"dataset.root={tmp_path}"))
    assert (imagenet.model.arch, imagenet.dataset.name, imagenet.train.epochs) == ("resnet50", "imagefolder", 90)
    assert (imagenet.optim.lr, imagenet.optim.weight_decay, imagenet.loss.label_smoothing) == (0.1, 1e-4, 0.1)
    with pytest.raises(ConfigError, match="dataset.root is required"):
        validate(compose_cfg("experiment=imagenet_resnet50"))


def test_the_torchvision_recipe_carries_its_published_values(tmp_path: Path) -> None:
    """experiment=imagenet_resnet50_tv: the values of torchvision's ResNet-50 "new recipe" (cited in the file), and
    its 176-px training crops with 224-px validation crops after a 232-px resize."""
    tv = validate(compose_cfg("experiment=imagenet_resnet50_tv", f"dataset.root={tmp_path}"))
    ds, train = tv.dataset, tv.train
    assert (tv.model.arch, ds.image_size, ds.val_resize, ds.val_image_size) == ("resnet50", 176, 232, 224)
    assert (ds.augment, ds.random_erasing, tv.loss.label_smoothing) == ("trivialaugment", 0.1, 0.1)
    assert (type(tv.optim), tv.optim.lr, tv.optim.weight_decay, tv.optim.momentum) == (SGDConfig, 0.5, 2e-5, 0.9)
    assert (tv.data.batch_size, train.epochs, tv.schedule.warmup_epochs) == (128, 600, 5)
    assert (train.mixup_alpha, train.cutmix_alpha, train.ema_every_n_steps) == (0.2, 1.0, 32)
    assert train.ema_decay == pytest.approx(1 - (1 - 0.99998) * 8 * 128 * 32 / 600, abs=1e-5)
    assert tv.checkpoint.best_of == "ema"
    training, validation = imagenet_transforms(ds.image_size, ds.val_resize, ds.augment, val_image_size=224)
    assert (spec_of(training).size, spec_of(validation).size) == (176, 224)
    assert [type(t).__name__ for t in validation.transforms] == ["Resize", "CenterCrop"]
    assert validation.transforms[0].size == [232]


def test_the_shapes_recipe_turns_on_every_recipe_knob() -> None:
    recipe = validate(compose_cfg("experiment=shapes_recipe"))
    assert (recipe.dataset.name, recipe.dataset.augment, recipe.checkpoint.best_of) == (
        "shapes",
        "trivialaugment",
        "ema",
    )
    assert recipe.train.mixup_alpha > 0 and recipe.train.cutmix_alpha > 0 and recipe.train.ema_decay is not None
    assert recipe.dataset.random_erasing > 0 and recipe.loss.label_smoothing > 0


def test_every_former_trainer_key_has_one_new_place_that_exists() -> None:
    """trainer.* was split by concern: the 23 keys map one to one onto keys of the new groups."""
    assert len(MOVED_KEYS) == 23 and len(set(MOVED_KEYS.values())) == 23
    defaults = _schema_defaults(Config)
    for new in MOVED_KEYS.values():
        group, key = new.split(".")
        schema = {"train": TrainConfig, "system": SystemConfig, "checkpoint": CheckpointConfig}.get(group)
        schema = schema or {"metrics": MetricsConfig, "faults": FaultsConfig}.get(group)
        schema = schema or {"loss": CrossEntropyConfig, "schedule": WarmupCosineConfig}[group]  # the defaults'
        assert key in _schema_defaults(schema), new
    assert "trainer" not in defaults


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.epochs=3", "trainer.epochs is now train.epochs (trainer.* was split by concern"),
        ("trainer.warmup_steps=0", "trainer.warmup_steps is now metrics.skip_first_steps"),
        ("trainer.save_checkpoints=false", "trainer.save_checkpoints is now checkpoint.save"),
        ("+trainer.nonfinite=skip", "trainer.nonfinite is now faults.nonfinite"),
        ("trainer=default", "trainer.* was split by concern into train, system, checkpoint, metrics and faults"),
        ("train.label_smoothing=0.1", "train.label_smoothing is now loss.label_smoothing (the loss and the LR"),
        ("train.lr_warmup_epochs=2", "train.lr_warmup_epochs is now schedule.warmup_epochs"),
        ("+train.label_smoothing=0.1", "train.label_smoothing is now loss.label_smoothing"),
    ],
)
def test_a_former_trainer_key_gets_one_line_naming_its_new_place(override: str, expected: str) -> None:
    with pytest.raises((ConfigCompositionException, ConfigError)) as caught:  # `+` composes, validate refuses
        validate(compose_cfg(override))
    line = one_line(caught.value)
    assert expected in line and "\n" not in line, line


@pytest.mark.parametrize("dataset", sorted(p.stem for p in (CONF_DIR / "dataset").glob("*.yaml")))
def test_debug_fast_composes_and_validates_with_every_dataset(dataset: str, tmp_path: Path) -> None:
    """Its size keys are the dataset's own (conf/debug_dataset/): generated sets shrink, the others stop early."""
    settings = validate(compose_cfg("debug=fast", f"dataset={dataset}", *_dataset_args(dataset, tmp_path)))
    assert settings.dataset.image_size == 32 and settings.data.batch_size == 32
    if hasattr(settings.dataset, "num_train"):
        assert (settings.dataset.num_train, settings.dataset.num_val, settings.train.max_steps) == (256, 64, None)
    else:
        assert settings.train.max_steps == 8
    assert (CONF_DIR / "debug_dataset" / f"fast_{dataset}.yaml").exists()  # a new dataset gets its own size too


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["+model.depth=3"],
            "model.depth is not a parameter of imgtrain.train.model.build_torchvision; it takes: arch, cifar_stem, "
            "zero_init_residual, pretrained (num_classes from the run)",
        ),
        (
            ["schedule=step", "+schedule.power=2"],
            "schedule.power is not a parameter of imgtrain.train.schedules.warmup_step; it takes: warmup_epochs, "
            "step_epochs, gamma (optimizer, steps_per_epoch, total_steps from the run)",
        ),
        (["loss=focal", "+loss.weight=1"], "loss.weight is not a parameter of imgtrain.train.losses.FocalLoss; it"),
    ],
    ids=["model", "schedule", "loss"],
)
def test_a_key_the_builder_does_not_take_is_one_line_before_any_data(
    overrides: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`+model.depth=3` used to fail once the DataLoaders were planned; a schedule's, with the builder's TypeError."""

    def no_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data was touched before the config was checked")

    monkeypatch.setattr(run_module, "build_data", no_data)
    with pytest.raises(ConfigError) as info:
        run(compose_cfg(*overrides, output_dir=str(tmp_path)))
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_a_forks_schedule_without_a_schema_is_checked_against_its_builder() -> None:
    """A fork's conf/schedule/<name>.yaml has no schema: its keys are a plain node, checked the same way."""
    cfg = compose_cfg()
    cfg.schedule = OmegaConf.create({"_target_": "imgtrain.train.schedules.warmup_cosine", "step_epochs": 1})
    with pytest.raises(ConfigError, match=r"^schedule.step_epochs is not a parameter of .*warmup_cosine; it takes"):
        validate(cfg)
    cfg.schedule = OmegaConf.create({"_target_": "imgtrain.train.schedules.warmup_cosine", "warmup_epochs": 1})
    assert validate(cfg).schedule["warmup_epochs"] == 1


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_help_lists_the_options_not_the_schemas(tmp_path: Path) -> None:
    """The ConfigStore's `base_...` entries are the YAML files' bases, not choices: --help leaves them out."""
    shown = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    groups = shown.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert shown.returncode == 0 and "model: " in groups and "optim: adamw, sgd" in groups, shown.stdout[:2000]
    assert "base_" not in groups
