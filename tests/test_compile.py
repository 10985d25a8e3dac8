"""system.compile_mode and what CUDA graphs need, checked on the CPU: everything but their speed.

torch.compile is replaced by a recorder here (compiling on 2 cores takes a minute; test_run.py's slow test
compiles for real), and the CUDA calls by fakes, so these tests see which callable runs, in which mode, with
which step marks and syncs.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FAST, compose_cfg, cuda_roll
from hydra.errors import ConfigCompositionException
from torch._dynamo.utils import counters
from torchvision.transforms import v2

from imgtrain.common.errors import ConfigError
from imgtrain.config.system import CompileMode, Precision
from imgtrain.config.validate import validate
from imgtrain.host.dist import DistInfo
from imgtrain.train.cli import one_line
from imgtrain.train.placement import evaluation_module, prepare_model
from imgtrain.train.probe import ModelProbe, StepClock
from imgtrain.train.run import run
from imgtrain.train.step import Step, build_step

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # CUDA: only its type is read, nothing runs there


def _settings(*overrides: str):
    return validate(compose_cfg(*FAST, "system.device=cpu", *overrides))


class Compiled(torch.nn.Module):
    """What the recorder hands back for torch.compile: calls go through, counted, with the mode kept."""

    def __init__(self, module: torch.nn.Module, mode: str | None) -> None:
        super().__init__()
        self._orig_mod, self.mode, self.calls, self.batches = module, mode, 0, []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.batches.append((images.shape[0], self.training))
        return self._orig_mod(images)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[Compiled]:
    made: list[Compiled] = []

    def record(module: torch.nn.Module, mode: str | None = None, **_: object) -> Compiled:
        made.append(Compiled(module, mode))
        return made[-1]

    monkeypatch.setattr(torch, "compile", record)
    return made


def test_compile_modes_are_checked_by_name_with_one_line() -> None:
    assert _settings("system.compile_mode=reduce_overhead").system.compile_mode == CompileMode.reduce_overhead
    assert str(CompileMode.reduce_overhead) == "reduce-overhead"  # torch's name, passed to torch.compile
    with pytest.raises(ConfigCompositionException) as error:  # torch's spelling: the line lists the names
        _settings("system.compile_mode=reduce-overhead")
    assert "expected one of [default, reduce_overhead, max_autotune, max_autotune_no_cudagraphs]" in one_line(
        error.value
    )
    assert [m.records_cuda_graphs for m in CompileMode] == [False, True, True, False]


def test_cuda_graphs_refuse_a_last_batch_of_another_shape() -> None:
    with pytest.raises(ConfigError, match="system.compile_mode=reduce_overhead records CUDA graphs for one batch"):
        _settings("system.compile=true", "system.compile_mode=reduce_overhead", "data.drop_last=false")
    _settings("system.compile=false", "system.compile_mode=reduce_overhead", "data.drop_last=false")  # not compiled
    _settings("system.compile=true", "system.compile_mode=max_autotune_no_cudagraphs", "data.drop_last=false")


def test_the_model_is_compiled_in_the_mode_set(compiles: list[Compiled]) -> None:
    settings = _settings("system.compile=true", "system.compile_mode=max_autotune")
    model, base = prepare_model(settings, 10, CPU, torch.contiguous_format, DistInfo())
    assert model is compiles[0] and model.mode == "max-autotune" and model._orig_mod is base


@pytest.mark.parametrize(("mode", "device", "marks"), [("reduce_overhead", CUDA, 2), ("reduce_overhead", CPU, 0),
                                                        ("default", CUDA, 0)])  # fmt: skip
def test_each_forward_marks_a_new_cuda_graph_step(mode: str, device, marks: int, monkeypatch) -> None:
    """Before every forward (nonfinite=skip's forward with no backward too): a replay may then overwrite the last
    step's outputs. Only where graphs are replayed: a compile mode that records them, on a CUDA device."""
    seen: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: seen.append(1))
    settings = _settings("system.compile=true", f"system.compile_mode={mode}")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    step = build_step(settings, model, device, Precision.fp32, (4, 4))
    images, labels = torch.randn(2, 3, 2, 2), torch.tensor([0, 2])
    _, loss = step.forward(model, images, labels)  # a step whose update was skipped: no backward
    _, loss = step.forward(model, images, labels)
    step.update(loss, schedule=False)
    assert len(seen) == marks and step.cuda_graphs == bool(marks)


def test_validation_with_cuda_graphs_runs_the_uncompiled_module(compiles: list[Compiled]) -> None:
    """Validation's batch size, and its smaller last batch, would record graphs of their own."""
    model, base = prepare_model(_settings("system.compile=true"), 10, CPU, torch.contiguous_format, DistInfo())
    assert evaluation_module(model, cuda_graphs=True) is base
    assert evaluation_module(model, cuda_graphs=False) is model


@pytest.mark.slow  # slow: the fast suite's budget (make test <= 120 s on 2 cores); CI runs it in make test-slow
def test_validation_runs_a_batch_of_another_size_uncompiled(compiles: list[Compiled], tmp_path) -> None:
    """The compiled model validates full batches only (one more compile, for inference): the last, smaller batch
    would make it compile again, so it runs eagerly. 70 validation images in batches of 64: 64 compiled, 6 not."""
    run(compose_cfg(*FAST, "system.device=cpu", "system.compile=true", "dataset.num_val=70", output_dir=str(tmp_path)))
    run_model = compiles[0]
    assert [size for size, training in run_model.batches if not training] == [64]
    assert [size for size, training in run_model.batches if training] == [32] * 8
    assert json.loads((tmp_path / "metrics.json").read_text())["val_count"] == 70


# 8 steps of 16: train.seed=0 draws unmixed, MixUp, CutMix, MixUp, CutMix, CutMix, MixUp, MixUp (train.mix_prob=0.8);
# 16 validation images, less than one validation batch (32): validated eagerly, so nothing else compiles
RECIPE = [
    "model._target_=test_recipe.tiny_cnn",
    "dataset=synthetic",
    "dataset.image_size=32",
    "dataset.num_train=128",
    "dataset.num_val=16",
    "dataset.num_classes=4",
    "dataset.random_erasing=0.5",
    "data.batch_size=16",
    "data.num_workers=0",
    "train.epochs=1",
    "train.mixup_alpha=0.2",
    "train.cutmix_alpha=1.0",
    "train.mix_prob=0.8",
    "train.ema_decay=0.9",
    "system.device=cpu",
    "system.channels_last=true",
    "system.compile=true",
    "checkpoint.save=false",
    "metrics.compute_probe=false",
]


@pytest.mark.slow  # torch.compile builds a small CNN's forward and backward for real: C++ kernels on the CPU
def test_a_compiled_recipe_run_never_recompiles_after_its_first_step(tmp_path, monkeypatch) -> None:
    """Mixup, cutmix, an EMA, channels_last and random erasing, compiled, with the layouts a CUDA run's mixing
    produces (cuda_roll: MixUp's roll is NCHW there): the graphs compiled at the first step serve every draw. A batch
    in another layout recompiles the forward and backward ("stride mismatch at index 1"), with reduce-overhead
    records a second set of CUDA graphs."""
    cuda_roll(monkeypatch)
    graphs: list[int] = []  # Dynamo's graphs compiled so far, after each training forward
    draws: set[str] = set()  # each step's draw: which mix (torchvision's own transform, spied on), or none

    def spied(make_params):  # the transform's own draw, recorded and returned
        return lambda self, inputs: draws.add(type(self).__name__) or make_params(self, inputs)

    for mix in (v2.MixUp, v2.CutMix):
        monkeypatch.setattr(mix, "make_params", spied(mix.make_params))
    real_forward = Step.forward

    def forward(self: Step, model, images, targets, *args, **kwargs):
        if targets.ndim == 1:  # hard labels: a batch left unmixed
            draws.add("unmixed")
        out = real_forward(self, model, images, targets, *args, **kwargs)
        graphs.append(counters["stats"]["unique_graphs"])
        return out

    monkeypatch.setattr(Step, "forward", forward)
    torch._dynamo.reset()  # no graph or recompile budget left over from another test in this process
    run(compose_cfg(*RECIPE, output_dir=str(tmp_path)))
    assert draws == {"MixUp", "CutMix", "unmixed"} and len(graphs) == 8
    assert graphs[-1] == graphs[0] > 0, f"Dynamo graphs after each step: {graphs}"
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 8


def test_the_probe_times_the_model_compiled_as_the_run_compiles_it(compiles: list[Compiled]) -> None:
    settings = _settings("system.compile=true", "system.compile_mode=reduce_overhead", "mode=loader")
    _, base = prepare_model(settings, 10, CPU, torch.contiguous_format, DistInfo())
    probe = ModelProbe(base, 10, settings, CPU, Precision.fp32, torch.contiguous_format)
    probe.ready()
    probed = compiles[-1]
    assert len(compiles) == 2 and probed.mode == "reduce-overhead"
    assert probed._orig_mod is not base  # a copy: the run's weights and statistics stay untouched
    warm = probed.calls
    rate = probe(seconds=0.0, min_steps=6)
    assert probed.calls == warm + 6 and rate.samples == 6 and rate.interval is not None
    before = [p.detach().clone() for p in base.parameters()]
    probe(seconds=0.0, min_steps=2)
    assert len(compiles) == 2  # built once, compiled once
    assert all(torch.equal(a, b) for a, b in zip(before, base.parameters(), strict=True))
    probe.release()
    assert probe.parts is None


def test_the_step_clock_reads_cuda_events_once_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync per step would leave the GPU idle between steps: a launch-bound model would read slower."""
    import fakecuda

    fakecuda.install(monkeypatch)
    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    monkeypatch.setattr(fakecuda.FakeEvent, "synchronize", lambda self: syncs.append(1))
    clock = StepClock(CUDA)
    for _ in range(5):
        clock.mark()
    assert syncs == []
    seconds = clock.seconds()
    assert len(seconds) == 4 and all(s >= 0 for s in seconds) and syncs == [1]
