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


class ModelNotFoundError(EmberError):
    """A request names a model this server does not serve."""

    http_status = 404


class AuthenticationError(EmberError):
    """A request without the server's --api-key."""

    http_status = 401


class ParamError(InvalidRequestError):
    """A 400 that names the offending request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GrammarError(InvalidRequestError):
    """A constraint the grammar library cannot build: says which field and what is wrong."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class UnenforcedKeywordError(InvalidRequestError):
    """A JSON schema keyword the grammar would silently not enforce (ember.structured.schema_check)."""


class ServerOverloadedError(EmberError):
    """The waiting queue is full: the client should retry later."""

    http_status = 503


class EngineDeadError(EmberError):
    """The engine thread is gone (shut down); nothing more can be served."""

    http_status = 503
