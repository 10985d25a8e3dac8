"""The training recipe as choices (issue 32): the loss, schedule and optimiser groups by `_target_`, mixup/cutmix on the
device batch, the weights' EMA beside the model, and the one list of what validation computes."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from helpers import compose_cfg, cuda_roll
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from imgtrain.config.train import TrainConfig
from imgtrain.config.val_metrics import VAL_METRICS, batch_sums, field, summary_fields
from imgtrain.config.validate import validate
from imgtrain.metrics.processor import Metrics
from imgtrain.resilience.checkpoint import Checkpointer, Progress
from imgtrain.resilience.faults import Preempted
from imgtrain.train.ema import WeightAverage
from imgtrain.train.losses import FocalLoss
from imgtrain.train.mixing import Mixing, step_seed
from imgtrain.train.run import run
from imgtrain.train.schedules import warmup_step
from imgtrain.train.step import Step, build_optimizer, build_step


def tiny_cnn(num_classes: int, **torchvision_keys: object) -> nn.Module:
    """A model of milliseconds per step (model._target_=test_recipe.tiny_cnn), with BatchNorm statistics for the EMA
    to average. `torchvision_keys`: model=torchvision's other keys, unused."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


# 64 training images in 4 steps of 16 per epoch, 32 validation images of 4 classes, a tiny model: seconds on 2 cores
TINY = [
    "model._target_=test_recipe.tiny_cnn",
    "dataset=synthetic",
    "dataset.image_size=32",
    "dataset.num_train=64",
    "dataset.num_val=32",
    "dataset.num_classes=4",
    "data.batch_size=16",
    "data.num_workers=0",
    "metrics.skip_first_steps=1",
    "metrics.log_every_n_steps=2",
    "metrics.monitor_interval_s=0.1",
    "metrics.compute_probe=false",
]
MIXED = ["train.mixup_alpha=0.2", "train.cutmix_alpha=1.0", "train.mix_prob=0.8"]


def _scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def _checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


# ----------------------------------------------------------------------------- loss
def test_focal_loss_is_cross_entropy_at_gamma_0_and_smaller_at_gamma_2() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(16, 10) * 3, torch.randint(0, 10, (16,))
    for smoothing in (0.0, 0.1):
        ce = F.cross_entropy(logits, labels, label_smoothing=smoothing)
        assert torch.allclose(FocalLoss(gamma=0.0, label_smoothing=smoothing)(logits, labels), ce, atol=1e-6)
        assert FocalLoss(gamma=2.0, label_smoothing=smoothing)(logits, labels) < ce
    soft = torch.softmax(torch.randn(16, 10), dim=1)  # mixup's targets: probabilities [B, C]
    assert torch.allclose(FocalLoss(gamma=0.0)(logits, soft), F.cross_entropy(logits, soft), atol=1e-6)
    assert FocalLoss(gamma=2.0)(logits, soft) < F.cross_entropy(logits, soft)


# ----------------------------------------------------------------------------- schedule and optimiser
def test_step_decay_warms_up_then_drops_by_gamma_every_step_epochs() -> None:
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scheduler = warmup_step(
        optimizer, steps_per_epoch=4, total_steps=40, warmup_epochs=1, step_epochs=2, gamma=0.1
    )  # 4 warm-up steps, then x0.1 every 8 steps
    lrs = []
    for _ in range(30):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])  # base x (k + 1) / 4, then the base LR
    assert lrs[11:13] == pytest.approx([1.0, 0.1]) and lrs[19:21] == pytest.approx([0.1, 0.01])
    assert lrs[28:30] == pytest.approx([0.001, 0.001])


def test_scale_lr_with_batch_multiplies_by_global_batch_over_256_and_says_so(caplog) -> None:
    settings = validate(
        compose_cfg("optim=sgd", "optim.lr=0.1", "optim.scale_lr_with_batch=true", "data.batch_size=64")
    )
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    caplog.set_level(logging.INFO)
    step = build_step(settings, model, torch.device("cpu"), "fp32", (8, 16), world_size=2)
    assert step.optimizer.param_groups[0]["initial_lr"] == pytest.approx(0.1 * 128 / 256)
    assert "scale_lr_with_batch" not in step.optimizer.defaults  # not the optimizer's key
    assert "lr 0.05 = optim.lr 0.1 x global batch 128 / 256 (optim.scale_lr_with_batch=true)" in caplog.text
    unscaled = validate(compose_cfg("optim=sgd", "optim.lr=0.1", "data.batch_size=64"))
    assert build_step(unscaled, model, torch.device("cpu"), "fp32", (8, 16)).optimizer.defaults["lr"] == 0.1


def test_any_torch_optimizer_fused_only_where_it_has_a_fused_kernel() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    rmsprop = build_optimizer({"_target_": "torch.optim.RMSprop", "lr": 0.01, "weight_decay": 1e-4}, model, 32)
    assert type(rmsprop) is torch.optim.RMSprop and "fused" not in rmsprop.defaults  # RMSprop has no fused kernel
    assert [group["weight_decay"] for group in rmsprop.param_groups] == [1e-4, 0.0]  # none on BatchNorm and biases
    sgd = build_optimizer({"_target_": "torch.optim.SGD", "lr": 0.1}, model, 32)
    assert sgd.defaults["fused"] is True
    asked = build_optimizer({"_target_": "torch.optim.Adam", "lr": 0.1, "fused": False}, model, 32)
    assert asked.defaults["fused"] is False  # the user's choice stands
    lbfgs = build_optimizer({"_target_": "torch.optim.LBFGS", "lr": 1}, model, 32)  # no weight decay: one group
    assert len(lbfgs.param_groups) == 1


# ----------------------------------------------------------------------------- mixing
def test_mixing_gives_soft_targets_and_is_a_function_of_seed_and_step() -> None:
    mixing = Mixing(TrainConfig(mixup_alpha=0.2, cutmix_alpha=1.0, seed=3), num_classes=4)
    images, labels = torch.randn(8, 3, 16, 16), torch.arange(8) % 4
    state = torch.get_rng_state()
    first = mixing(images, labels, step=5)
    assert torch.equal(torch.get_rng_state(), state)  # no other randomness moved
    torch.rand(100)  # the global generator elsewhere: the draw does not depend on it
    again, later = mixing(images, labels, step=5), mixing(images, labels, step=6)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], later[0])
    mixed, targets = first
    assert targets.shape == (8, 4) and torch.allclose(targets.sum(dim=1), torch.ones(8))
    assert not torch.equal(mixed, images)  # and the input batch is left as it was
    assert Mixing(TrainConfig(seed=4, mixup_alpha=0.2, cutmix_alpha=1.0), 4)(images, labels, 5)[1].ne(targets).any()
    off = Mixing(TrainConfig(), num_classes=4)  # the default: the identity, no draw
    assert off(images, labels, 5)[0] is images and off(images, labels, 5)[1] is labels
    never = Mixing(TrainConfig(mixup_alpha=0.2, mix_prob=0.0), num_classes=4)
    assert never(images, labels, 5)[1] is labels  # mix_prob=0: the hard labels


@pytest.mark.parametrize("memory_format", [torch.channels_last, None])  # the run's, or the batch's own
def test_every_mixed_batch_keeps_the_models_memory_format_as_a_cuda_run_mixes_it(memory_format, monkeypatch) -> None:
    """On CUDA, MixUp's output (a roll) is NCHW whatever its input's layout (cuda_roll emulates it): the model, built
    channels_last, must get channels_last from every draw (MixUp, CutMix, unmixed), with torchvision's values."""
    cuda_roll(monkeypatch)
    mixing = Mixing(TrainConfig(mixup_alpha=0.2, cutmix_alpha=1.0, mix_prob=0.8), 4, memory_format)
    images = torch.randn(8, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    labels = torch.arange(8) % 4
    draws = set()
    for step in range(8):
        mixed, targets = mixing(images, labels, step)
        with torch.random.fork_rng(devices=[]):  # torchvision's own output for this step's draw
            torch.default_generator.manual_seed(step_seed(0, step))
            expected, expected_targets = mixing.transform(images, labels)
        draws.add((targets.ndim, expected.is_contiguous(memory_format=torch.channels_last)))
        assert mixed.is_contiguous(memory_format=torch.channels_last), (step, draws)
        assert torch.equal(mixed, expected) and torch.equal(targets, expected_targets)
    # steps 0-7 of train.seed=0 draw each: unmixed (hard labels), CutMix (a clone: channels_last), MixUp (NCHW)
    assert draws == {(1, True), (2, True), (2, False)}


# ----------------------------------------------------------------------------- EMA and validation's list
def test_ema_averages_weights_and_batchnorm_statistics_every_n_steps() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ema = WeightAverage(model, decay=0.5, every=2)
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    ema.after_step(1)  # not an update step
    assert not torch.equal(ema.module[0].weight, model[0].weight)
    ema.after_step(2)  # the first update copies
    assert torch.equal(ema.module[0].weight, model[0].weight)
    with torch.no_grad():
        model[0].weight.fill_(3.0)
        model[1].running_mean.fill_(4.0)
    ema.after_step(4)
    assert torch.allclose(ema.module[0].weight, torch.full((2, 2), 2.0))  # 0.5 x 1 + 0.5 x 3
    assert torch.allclose(ema.module[1].running_mean, torch.full((2,), 2.0))  # buffers too: 0.5 x 0 + 0.5 x 4
    saved = ema.state_dict()
    assert int(saved["ema_updates"]) == 2 and set(saved["ema"]) == set(model.state_dict())


class AtenOps(TorchDispatchMode):
    """The aten ops run inside it, by name: on the CPU, what would be kernel launches on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _trained(model: nn.Module, steps: int) -> None:
    """`steps` training-mode forwards (BatchNorm's statistics and counts move) and a nudge of the weights."""
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(steps)))
        for param in model.parameters():
            param.add_(0.01)


def _same(module: nn.Module, other: nn.Module) -> None:
    theirs = other.state_dict()
    for name, value in module.state_dict().items():
        assert torch.equal(value, theirs[name]), name


def test_an_ema_update_is_a_few_foreach_calls_and_copies_the_batchnorm_counts() -> None:
    """ResNet-18: 102 floating tensors and 20 num_batches_tracked (int64), two (device, dtype) groups. Each update is
    a few ops per group, not one per tensor (the first was 124, then 83, 80 of them averaging the counts), and a
    count is copied, not averaged (0.9 x 1 + 0.1 x 4 truncated to 1). A resumed EMA updates as the first one."""
    model = torchvision.models.resnet18(num_classes=4)
    ema = WeightAverage(model, decay=0.9, every=1)
    _trained(model, 1)  # the model moves away from the EMA's copy of it
    with AtenOps() as first:
        ema.after_step(1)  # the first update copies
    _same(ema.module, model)
    _trained(model, 3)
    before = ema.module.conv1.weight.clone()
    with AtenOps() as second:
        ema.after_step(2)
    assert len(ema.groups) == 2 and len(first.names) <= 3 * 2 and len(second.names) <= 3 * 2, second.names
    assert ema.module.bn1.num_batches_tracked.item() == model.bn1.num_batches_tracked.item() == 4
    assert torch.allclose(ema.module.conv1.weight, 0.9 * before + 0.1 * model.conv1.weight)
    assert ema.averaged.n_averaged.device.type == "cpu"  # read each update (first or not): no device sync
    fresh = torchvision.models.resnet18(num_classes=4)
    resumed = WeightAverage(fresh, decay=0.9, every=1)  # built before the checkpoint loads, as a run does
    fresh.load_state_dict(model.state_dict())
    resumed.load_state_dict(ema.state_dict())
    for average in (ema, resumed):
        _trained(average.base, 2)
        average.after_step(3)
    _same(ema.module, resumed.module)
    assert int(resumed.averaged.n_averaged) == 3 and resumed.module.bn1.num_batches_tracked.item() == 6


def test_best_follows_the_model_or_the_ema() -> None:
    progress = Progress()
    assert progress.validated({"val_acc": 0.5, "val_acc_ema": 0.4}, ema_best=True)
    assert not progress.validated({"val_acc": 0.6, "val_acc_ema": 0.3}, ema_best=True)  # only the model improved
    assert (progress.best_val_acc, progress.best_val_acc_ema) == (0.6, 0.4)
    assert progress.validated({"val_acc": 0.7, "val_acc_ema": 0.2})  # checkpoint.best_of=model
    assert Progress().validated({"val_acc": 0.1})  # no EMA


def test_validation_sums_every_listed_metric_in_one_pass() -> None:
    logits = torch.tensor([[5.0, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5], [1, 5, 0, 2, 3, 4]])
    labels = torch.tensor([0, 0, 0])  # the true class ranks 1st, 6th and 5th of the 6
    sums = dict(zip((metric.key for metric in VAL_METRICS), batch_sums(logits, labels).tolist(), strict=True))
    assert sums["acc"] == 1 and sums["acc5"] == 2
    assert sums["loss"] == pytest.approx(F.cross_entropy(logits, labels, reduction="sum").item())
    few = batch_sums(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))  # 3 classes: top-5 is top-3, always right
    assert few[[metric.key for metric in VAL_METRICS].index("acc5")] == 4


# ----------------------------------------------------------------------------- a run with all of it
def test_a_run_with_a_plain_optimizer_entry_focal_loss_step_decay_mixing_and_ema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An optimizer file with no schema (a plain `_target_` entry, as a fork writes), focal loss, step decay, mixup and
    cutmix, and an EMA that best.pt follows: the loss gets the mixed targets, train accuracy the hard labels, and
    validation reports the model and its EMA, in metrics.json, TensorBoard and the console."""
    seen = {"targets": set(), "labels": set()}
    forward, step = Step.forward, Metrics.on_step_end
    monkeypatch.setattr(
        Step, "forward", lambda self, m, x, t, **k: seen["targets"].add(t.ndim) or forward(self, m, x, t, **k)
    )
    monkeypatch.setattr(
        Metrics,
        "on_step_end",
        lambda self, n, loss, y, labels: seen["labels"].add(labels.ndim) or step(self, n, loss, y, labels),
    )
    cfg = compose_cfg(*TINY, *MIXED, "loss=focal", "schedule=step", "schedule.step_epochs=1", "train.epochs=2",
                      "train.ema_decay=0.5", "checkpoint.best_of=ema", "optimized_metric=val_acc5_ema",
                      output_dir=str(tmp_path))  # fmt: skip
    cfg.optim = OmegaConf.create({"_target_": "torch.optim.RMSprop", "lr": 1e-3, "weight_decay": 1e-4})
    value = run(cfg)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert seen == {"targets": {1, 2}, "labels": {1}}  # some batches left unmixed (mix_prob=0.8): hard labels
    assert list(metrics)[list(metrics).index("val_acc") :][: len(summary_fields())] == list(summary_fields())
    assert value == metrics["val_acc5_ema"] and all(0 <= metrics[name] <= 1 for name in ("val_acc5", "val_acc_ema"))
    assert metrics["val_acc"] <= metrics["val_acc5"] and metrics["val_count"] == 32
    assert f"val acc (top-5)              {metrics['val_acc5']:.4f} (EMA " in capsys.readouterr().out
    lr = dict(_scalars(tmp_path, "lr"))  # after each window's last step: x0.1 after every epoch of 4 steps
    assert (lr[2], lr[6]) == (pytest.approx(1e-3), pytest.approx(1e-4))
    for metric in VAL_METRICS:
        assert [s for s, _ in _scalars(tmp_path, f"val/{metric.key}")] == [4, 8]
        assert [s for s, _ in _scalars(tmp_path, f"val_ema/{metric.key}")] == [4, 8]
    ema_acc = _scalars(tmp_path, "val_ema/acc")
    best_step, best = max(ema_acc, key=lambda point: (point[1], -point[0]))  # the first epoch of the best EMA
    best_pt = _checkpoint(tmp_path / "checkpoints" / "best.pt")
    assert best_pt["progress"]["step"] == best_step and best_pt["progress"]["best_val_acc_ema"] == pytest.approx(best)
    assert metrics["best_val_acc_ema"] == pytest.approx(best) and set(best_pt["ema"]) == set(best_pt["model"])
    assert _checkpoint(tmp_path / "checkpoints" / "last.pt")["optimizer"]["param_groups"][0]["centered"] is False


@pytest.mark.slow  # three runs of 8 steps of a tiny model: 3.1-3.6 s on 2 busy cores
def test_an_interrupted_run_with_mixing_and_ema_resumes_exactly(tmp_path: Path, monkeypatch) -> None:
    """A SIGTERM during step 5 (mid-epoch, between two EMA updates): saved, then continued in the same directory: the
    same weights, optimizer state and EMA as one uninterrupted run (deterministic, CPU)."""
    args = [*TINY, *MIXED, "train.epochs=2", "train.ema_decay=0.9", "train.ema_every_n_steps=2"]
    args += ["checkpoint.every_n_steps=3", "system.deterministic=true"]
    run(compose_cfg(*args, output_dir=str(tmp_path / "straight")))
    real_step = Checkpointer.step

    def signal_after_step_5(self: Checkpointer) -> None:
        if self.progress.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the run's handler; one process acts on it at once
        real_step(self)

    monkeypatch.setattr(Checkpointer, "step", signal_after_step_5)
    with pytest.raises(Preempted):
        run(compose_cfg(*args, output_dir=str(tmp_path / "part")))
    monkeypatch.undo()
    assert _checkpoint(tmp_path / "part" / "checkpoints" / "last.pt")["progress"]["step"] == 5
    run(compose_cfg(*args, output_dir=str(tmp_path / "part")))
    straight, resumed = (_checkpoint(tmp_path / name / "checkpoints" / "last.pt") for name in ("straight", "part"))
    assert straight["progress"]["step"] == resumed["progress"]["step"] == 8
    for key in ("model", "ema"):
        for name, tensor in straight[key].items():
            assert torch.equal(tensor, resumed[key][name]), (key, name)  # bit-identical, BatchNorm statistics too
    assert int(straight["ema_updates"]) == int(resumed["ema_updates"]) == 4
    for index, state in straight["optimizer"]["state"].items():
        assert all(torch.equal(value, resumed["optimizer"]["state"][index][k]) for k, value in state.items())
    assert field(VAL_METRICS[0], ema=True) in json.loads((tmp_path / "part" / "metrics.json").read_text())
