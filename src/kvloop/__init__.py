"""kvloop: an LLM serving engine built around an explicit, inspectable scheduler loop."""

from kvloop.config import CacheConfig, SchedulerConfig
from kvloop.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["CacheConfig", "SamplingParams", "SchedulerConfig", "__version__"]
