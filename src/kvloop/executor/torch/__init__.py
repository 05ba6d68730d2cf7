"""The PyTorch executor: paged-attention model runner, models, weight loader, sampler.

This is the only package of kvloop that imports torch.
"""

from kvloop.executor.torch.kv_cache import KVCache
from kvloop.executor.torch.loader import load_model, resolve_device, resolve_dtype
from kvloop.executor.torch.model_runner import TorchModelRunner
from kvloop.executor.torch.models import MODEL_REGISTRY, ModelConfig, get_model_class
from kvloop.executor.torch.sampler import Sampler, SamplingState

__all__ = [
    "MODEL_REGISTRY",
    "KVCache",
    "ModelConfig",
    "Sampler",
    "SamplingState",
    "TorchModelRunner",
    "get_model_class",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]
