"""kvloop: an LLM serving engine built around an explicit, inspectable scheduler loop."""

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.engine.args import EngineArgs
from kvloop.engine.llm import LLM
from kvloop.engine.llm_engine import LLMEngine
from kvloop.engine.outputs import RequestMetrics, RequestOutput
from kvloop.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CacheConfig",
    "EngineArgs",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "__version__",
]
