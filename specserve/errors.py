"""Errors meant for people: each names what was wrong, with the value and what is allowed."""


class SpecserveError(Exception):
    """Base class of every error specserve raises on purpose."""


class ConfigError(SpecserveError, ValueError):
    """A config file or keyword argument is wrong (unknown key, wrong type, out of range)."""


class ModelLoadError(SpecserveError):
    """A checkpoint cannot be loaded: missing file, unsupported architecture, bad tensor."""


class InvalidRequestError(SpecserveError, ValueError):
    """A request cannot be served as asked (prompt too long, bad sampling parameter)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
