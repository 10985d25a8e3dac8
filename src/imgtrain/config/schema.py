"""The whole config, `Config`: one node per group, each a schema of the group's own module (config/data.py,
config/model.py, ...), and the top-level keys; `register_configs` stores them in Hydra's ConfigStore.

The schemas are dataclasses, the one place every default is set. OmegaConf enforces the types and the Enum choices
at composition time, so `data.batch_size=abc` and `system.precision=fp8` fail before `run` starts, naming the key
and the accepted values. Range checks sit next to their fields (`checked`); config/validate.py runs them and the
checks that span fields. The YAML files in conf/ only choose between schemas and set what differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING, OmegaConf

from imgtrain.config.checkpoint import CheckpointConfig
from imgtrain.config.data import DataConfig
from imgtrain.config.datasets import dataset_schemas
from imgtrain.config.faults import FaultsConfig
from imgtrain.config.fields import Choice, at_least, checked
from imgtrain.config.loss import CrossEntropyConfig, FocalLossConfig
from imgtrain.config.metrics import MetricsConfig
from imgtrain.config.model import TimmModelConfig, TorchvisionModelConfig
from imgtrain.config.optim import AdamWConfig, SGDConfig
from imgtrain.config.schedule import StepDecayConfig, WarmupCosineConfig
from imgtrain.config.system import SystemConfig
from imgtrain.config.train import TrainConfig
from imgtrain.config.val_metrics import objectives


class Mode(Choice):
    train = "train"
    loader = "loader"  # the input pipeline and the copy, with a model that does nothing: its ceiling
    compute = "compute"  # the model on one batch already on the device: the compute ceiling


# The keys of metrics.json that `run` can return to a sweeper: validation's (config/val_metrics.py), and speed's
OBJECTIVES = (*objectives(), "images_per_sec", "data_wait_frac", "step_time_ms")


def _objective(value: Any) -> str | None:
    return None if value in OBJECTIVES else f"expected one of {', '.join(OBJECTIVES)}"


@dataclass
class Config:
    dataset: Any = MISSING  # a DatasetConfig; dataset=custom's keys become a CustomConfig in `validate`
    model: Any = MISSING  # TorchvisionModelConfig, TimmModelConfig, or a fork's entry with its own `_target_`
    data: DataConfig = MISSING
    optim: Any = MISSING  # any torch.optim optimizer by `_target_`; SGDConfig and AdamWConfig are typed
    loss: Any = MISSING  # any loss module by `_target_`
    schedule: Any = MISSING  # any LR-schedule builder by `_target_`
    train: TrainConfig = MISSING
    system: SystemConfig = MISSING
    checkpoint: CheckpointConfig = MISSING
    metrics: MetricsConfig = MISSING
    faults: FaultsConfig = MISSING
    mode: Mode = Mode.train
    optimized_metric: Any = checked("val_acc", _objective)  # what run() returns to a sweeper: a key of metrics.json
    # A sweep dimension that changes nothing: `-m repeat=0,1 data.num_workers=0,2` runs each setting twice,
    # interleaved (the first key varies slowest); the sweep report pools the repeats and measures the drift.
    repeat: int = checked(0, at_least(0))
    data_dir: str = "${oc.env:IMGTRAIN_DATA_DIR,'~/.cache/imgtrain'}"
    output_dir: str = "${hydra:runtime.output_dir}"


# Hydra's help page (hydra/help/default.yaml) with the groups listed by `config_groups` (conf/config.yaml picks it)
HELP = {
    "app_name": "${hydra.job.name}",
    "header": "${hydra.help.app_name} is powered by Hydra.\n",
    "footer": "Powered by Hydra (https://hydra.cc)\nUse --hydra-help to view Hydra specific help\n",
    "template": "${hydra.help.header}\n== Configuration groups ==\nCompose your configuration from those groups "
    "(group=option)\n\n${config_groups:}\n\n== Config ==\nOverride anything in the config (foo.bar=value)\n\n$CONFIG"
    "\n\n${hydra.help.footer}\n",
}


def config_groups() -> str:
    """`--help`'s groups and their options, as Hydra lists them less the schemas stored here (`base_...`): a
    YAML file's base, not a choice."""
    hydra = GlobalHydra.instance().hydra
    if hydra is None:
        return ""
    lines = []
    for group in sorted(hydra.list_all_config_groups()):
        if group != "hydra" and not group.startswith("hydra/"):
            options = [name for name in hydra.config_loader.get_group_options(group) if not name.startswith("base_")]
            lines.append(f"{group}: {', '.join(sorted(options))}")
    return "\n".join(lines)


def register_configs() -> None:
    """Store the schemas so the YAML files in conf/ can name them as their base (`- base_...`), and the help page
    that does not list them."""
    if not OmegaConf.has_resolver("config_groups"):
        OmegaConf.register_new_resolver("config_groups", config_groups)
    cs = ConfigStore.instance()
    cs.store(group="hydra/help", name="imgtrain", node=HELP)
    cs.store(name="base_config", node=Config)
    cs.store(group="data", name="base_data", node=DataConfig)
    for name, node in dataset_schemas().items():  # every DatasetConfig of config/datasets.py, as base_<name>
        cs.store(group="dataset", name=name, node=node)
    cs.store(group="model", name="base_torchvision", node=TorchvisionModelConfig)
    cs.store(group="model", name="base_timm", node=TimmModelConfig)
    cs.store(group="optim", name="base_sgd", node=SGDConfig)
    cs.store(group="optim", name="base_adamw", node=AdamWConfig)
    cs.store(group="loss", name="base_cross_entropy", node=CrossEntropyConfig)
    cs.store(group="loss", name="base_focal", node=FocalLossConfig)
    cs.store(group="schedule", name="base_warmup_cosine", node=WarmupCosineConfig)
    cs.store(group="schedule", name="base_step", node=StepDecayConfig)
    cs.store(group="train", name="base_train", node=TrainConfig)
    cs.store(group="system", name="base_system", node=SystemConfig)
    cs.store(group="checkpoint", name="base_checkpoint", node=CheckpointConfig)
    cs.store(group="metrics", name="base_metrics", node=MetricsConfig)
    cs.store(group="faults", name="base_faults", node=FaultsConfig)
