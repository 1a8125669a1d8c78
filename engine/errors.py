"""Errors the engine raises for bad input. Each message is one line that says what is wrong and where."""


class EngineError(Exception):
    """Base class of the engine's user-facing errors."""


class ConfigError(EngineError, ValueError):
    """A checkpoint's config.json is missing, unreadable or describes an unsupported model."""


class CheckpointError(EngineError, ValueError):
    """A checkpoint's weights are missing, malformed or of an unsupported type."""


class RequestError(EngineError, ValueError):
    """A prompt or sampling parameter cannot be served."""


class RequestAborted(EngineError):
    """The request was stopped by `Engine.abort` before it finished; its slot and blocks were freed."""
