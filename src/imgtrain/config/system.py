"""The `system` group's schema (conf/system/): where and how the model runs, and its choices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from imgtrain.config.fields import AUTO, Choice, auto_or_bool, checked


class Device(Choice):
    auto = "auto"  # cuda when available
    cpu = "cpu"
    cuda = "cuda"


class Precision(Choice):
    auto = "auto"  # bf16 on GPUs with native bf16 (compute capability 8.0+), else fp32
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"  # adds a GradScaler


class CompileMode(Choice):
    """torch.compile's `mode` (system.compile_mode): the names are typed on the command line, the values are
    torch's (reduce_overhead is torch's "reduce-overhead")."""

    default = "default"  # Inductor's fused kernels, launched one by one
    reduce_overhead = "reduce-overhead"  # and CUDA graphs: one launch per graph (launch-bound small models)
    max_autotune = "max-autotune"  # and Triton autotuning of matmuls and convolutions (long compile), CUDA graphs
    max_autotune_no_cudagraphs = "max-autotune-no-cudagraphs"

    @property
    def records_cuda_graphs(self) -> bool:
        """Whether this mode replays CUDA graphs (on a CUDA device): fixed shapes, a step-begin mark per step."""
        return self in (CompileMode.reduce_overhead, CompileMode.max_autotune)


@dataclass
class SystemConfig:
    """Where and how the model runs. system.<key>=..."""

    device: Device = Device.auto
    precision: Precision = Precision.auto
    channels_last: Any = checked(AUTO, auto_or_bool)  # auto: on for CUDA
    compile: bool = False  # torch.compile the model
    compile_mode: CompileMode = CompileMode.default  # with compile=true: default, reduce_overhead (CUDA graphs), ...
    deterministic: bool = False  # deterministic algorithms, cuDNN autotuning off: bit-exact reruns, also on GPU
