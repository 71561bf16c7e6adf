"""Detectors by name: how training, the artifact loader and the contract suite find them."""

from typing import Any

from models.contract import DetectorConfig, RecurrentDetector
from models.hybrid import HybridConfig, HybridDetector
from models.linear_transformer import LinearTransformerConfig, LinearTransformerDetector
from models.lstm import LSTMConfig, LSTMDetector
from models.transformer import TransformerConfig, TransformerDetector

REGISTRY: dict[str, tuple[type[DetectorConfig], type[RecurrentDetector]]] = {
    LSTMDetector.name: (LSTMConfig, LSTMDetector),
    TransformerDetector.name: (TransformerConfig, TransformerDetector),
    LinearTransformerDetector.name: (LinearTransformerConfig, LinearTransformerDetector),
    HybridDetector.name: (HybridConfig, HybridDetector),
}


def config_class(name: str) -> type[DetectorConfig]:
    """The config dataclass of detector `name`."""
    if name not in REGISTRY:
        raise ValueError(f"unknown detector {name!r}; known detectors: {sorted(REGISTRY)}")
    return REGISTRY[name][0]


def build_detector(name: str, config: DetectorConfig | dict[str, Any] | None = None) -> RecurrentDetector:
    """A freshly initialised detector; `config` as its dataclass, a dict from to_dict(), or None for defaults."""
    config_type = config_class(name)
    if config is None:
        config = config_type()
    elif isinstance(config, dict):
        config = config_type.from_dict(config)
    elif type(config) is not config_type:
        raise TypeError(f"detector {name!r} takes a {config_type.__name__}, got a {type(config).__name__}")
    if isinstance(config, HybridConfig):
        return HybridDetector(config, build_detector(config.base, hybrid_base_config(config)))
    return REGISTRY[name][1](config)


def hybrid_base_config(config: HybridConfig) -> DetectorConfig:
    """The base detector's config inside a hybrid's: the shared fields, then the base's own."""
    if config.base not in REGISTRY or config.base == HybridDetector.name:
        known = sorted(set(REGISTRY) - {HybridDetector.name})
        raise ValueError(f"hybrid: base {config.base!r} is not a sequence detector; choose one of {known}")
    return config_class(config.base)(**config.shared(), **dict(config.base_extra))
