"""Errors a user can cause. Each message says what to change; the server maps them to HTTP codes."""


class EmberError(Exception):
    """Base class for every error ember raises on purpose."""

    http_status = 400


class ConfigError(EmberError):
    """A flag, a flag combination or a knob value that cannot work."""


class ModelLoadError(EmberError):
    """A model path or file that cannot be read: missing, truncated, or inconsistent."""


class UnsupportedModelError(ModelLoadError):
    """An architecture or format ember does not implement."""


class DefaultModelMissingError(ModelLoadError):
    """No model given and the embedded default model is not installed."""


class InvalidRequestError(EmberError):
    """A request that cannot be served as asked (bad sampling params, prompt too long, ...)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt plus max_tokens does not fit max_model_len."""


class KVCacheTooSmallError(ConfigError):
    """The KV cache budget cannot hold even one sequence of max_model_len tokens."""


class DistributedError(EmberError):
    """A tensor-parallel worker died, or a collective failed or timed out: the engine cannot go on."""

    http_status = 503
