"""The model probe (train/probe.py) frees what it built, its compiled code included, and never hands its graphs to
the run's model: compiled for real, on a model of milliseconds per step."""

from __future__ import annotations

import gc
import socket
import weakref
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg
from test_recipe import tiny_cnn  # tests/test_recipe.py: the same small CNN
from torch import nn
from torch._dynamo import convert_frame
from torch._dynamo.backends.distributed import DDPOptimizer
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from imgtrain.config.system import Precision
from imgtrain.config.validate import validate
from imgtrain.host.dist import DistInfo
from imgtrain.train.placement import prepare_model
from imgtrain.train.probe import ModelProbe
from imgtrain.train.run import run
from imgtrain.train.step import build_step

CPU = torch.device("cpu")
TINY = [
    "model._target_=test_probe.TinyNet",
    "dataset=synthetic",
    "dataset.image_size=16",
    "dataset.num_train=64",
    "dataset.num_val=16",
    "dataset.num_classes=4",
    "data.batch_size=8",
    "system.device=cpu",
    "system.compile=true",
]


class TinyNet(nn.Module):
    """A model of milliseconds per step with a `forward` of its own, as torchvision's and timm's models have: under
    DDP Dynamo compiles that frame through its DDPOptimizer (a torch.nn container's forward it traces inside DDP's
    own frame, without it). `model_keys`: the model group's other keys, unused."""

    def __init__(self, num_classes: int, **model_keys: object) -> None:
        super().__init__()
        self.body = tiny_cnn(num_classes)  # 6 parameter tensors; BatchNorm statistics as a real model's

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images)


def _compiled_entries() -> int:
    """Dynamo's cache entries on every code object it has compiled: the compiled code this process holds."""
    codes = (ref() for ref in convert_frame.input_codes.seen)
    return sum(len(_debug_get_cache_entry_list(code)) for code in codes if code is not None)


def _held_by(probe: ModelProbe) -> list[weakref.ref]:
    """Weak references to what the probe built: its compiled callable, the copy's parameters (the optimizer's), the
    optimizer and its state tensors."""
    model, step = probe.parts[0], probe.parts[1]
    params = [param for group in step.optimizer.param_groups for param in group["params"]]
    state = [value for moments in step.optimizer.state.values() for value in moments.values()]
    return [weakref.ref(obj) for obj in (model, step.optimizer, *params, *state)]


@pytest.mark.slow  # torch.compile for real: inductor builds a small CNN's forward and backward as C++ kernels
def test_release_frees_the_probes_copy_and_compiled_code_and_leaves_the_runs() -> None:
    """data.num_workers=tune's probe runs before the run's model is first called, the contention probe after
    training: after each release nothing the probe built is alive, its compiled code included, the run's model
    compiles its own graph once and a probe after it leaves that graph in place."""
    torch._dynamo.reset()  # no compiled code left by another test in this process
    settings = validate(compose_cfg(*TINY))
    model, base = prepare_model(settings, 4, CPU, torch.contiguous_format, DistInfo())
    probe = ModelProbe(base, 4, settings, CPU, Precision.fp32, torch.contiguous_format)
    probe(seconds=0.0, min_steps=2)
    held = _held_by(probe)
    assert _compiled_entries() > 0 and len(held) == 2 + 6 * 4  # the callable, optimizer, 6 parameters, 3 moments each
    probe.release()
    gc.collect()
    assert [ref for ref in held if ref() is not None] == []
    assert _compiled_entries() == 0, "the probe's compiled code outlived release()"

    graphs = counters["stats"]["unique_graphs"]
    step = build_step(settings, base, CPU, Precision.fp32, (1, 1), num_classes=4, announce=False)
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))
    for _ in range(2):
        _, loss = step.forward(model, images, labels)
        step.update(loss, schedule=False)
    assert counters["stats"]["unique_graphs"] == graphs + 1  # its own graph, not the probe's
    trained = _compiled_entries()
    probe(seconds=0.0, min_steps=2)  # after training
    probe.release()
    assert _compiled_entries() == trained  # the probe's entries gone, the run's kept
    graphs = counters["stats"]["unique_graphs"]
    step.forward(model, images, labels)
    assert counters["stats"]["unique_graphs"] == graphs  # the run's graph is still there: nothing compiled again


@pytest.mark.slow  # two runs compiled for real, under a one-process gloo group
def test_a_tuned_run_under_torchrun_trains_a_graph_compiled_for_ddp(tmp_path: Path, monkeypatch) -> None:
    """The tune probe's graph is compiled outside DDP. The DDP-wrapped model must compile its own, through Dynamo's
    DDPOptimizer (split at DDP's buckets, so their all-reduces overlap the backward), once, as a run without the
    probe does; Dynamo would otherwise run the probe's graph for it (its guards check the module's type)."""
    compiles: list[int] = []  # graphs compiled through DDPOptimizer
    compile_fn = DDPOptimizer.compile_fn
    monkeypatch.setattr(DDPOptimizer, "compile_fn", lambda self, *args: compiles.append(1) or compile_fn(self, *args))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_PORT": str(port)}
    for key, value in {**torchrun, "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": "probe"}.items():
        monkeypatch.setenv(key, value)  # one torchrun process: the DDP path
    per_run = {}
    for workers in ("0", "tune"):
        torch._dynamo.reset()  # each run compiles as in a fresh process
        compiles.clear()
        overrides = [f"data.num_workers={workers}", "data.tune_budget_s=2", "train.max_steps=2"]
        quiet = ["metrics.compute_probe=false", "checkpoint.save=false"]
        run(compose_cfg(*TINY, *overrides, *quiet, output_dir=str(tmp_path / workers)))
        per_run[workers] = len(compiles)
    assert per_run == {"0": 1, "tune": 1}
