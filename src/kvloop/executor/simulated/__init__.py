"""Simulated execution: model/hardware specs, a roofline cost model, and the executor."""

from kvloop.executor.simulated.cost_model import CostModel, Efficiency
from kvloop.executor.simulated.executor import SimulatedExecutor
from kvloop.executor.simulated.specs import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    HardwareSpec,
    ModelSpec,
    get_hardware_spec,
    get_model_spec,
    num_cpu_blocks,
    num_gpu_blocks,
)

__all__ = [
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "CostModel",
    "Efficiency",
    "HardwareSpec",
    "ModelSpec",
    "SimulatedExecutor",
    "get_hardware_spec",
    "get_model_spec",
    "num_cpu_blocks",
    "num_gpu_blocks",
]
