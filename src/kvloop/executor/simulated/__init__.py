"""Simulated execution: model/hardware specs, the step cost model, and the executor."""

from kvloop.executor.simulated.cost_model import CostModel
from kvloop.executor.simulated.efficiency import (
    AttentionCurve,
    DeviceEfficiency,
    EngineOverhead,
    GemmCurve,
    MemoryOp,
    engine_overhead,
    fitted_efficiency,
)
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
    "AttentionCurve",
    "CostModel",
    "DeviceEfficiency",
    "EngineOverhead",
    "GemmCurve",
    "HardwareSpec",
    "MemoryOp",
    "ModelSpec",
    "SimulatedExecutor",
    "engine_overhead",
    "fitted_efficiency",
    "get_hardware_spec",
    "get_model_spec",
    "num_cpu_blocks",
    "num_gpu_blocks",
]
