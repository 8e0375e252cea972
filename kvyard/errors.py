"""Typed errors. Each one says what went wrong and where, so a caller can map it to a response."""


class KvyardError(Exception):
    """Base class of every error kvyard raises on purpose."""


class CheckpointError(KvyardError):
    """A checkpoint is missing, broken or incomplete. The message names the file and the reason."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint is readable but its architecture is not one kvyard implements."""


class TokenizerMismatchError(CheckpointError):
    """A draft model's tokenizer differs from its target's, so its token ids would mean other text."""


class InvalidRequestError(KvyardError, ValueError):
    """A request is malformed: bad sampling parameters, an empty prompt, and the like.

    `param` names the offending field so that servers can report it.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context window or the KV cache."""


class AdapterBusyError(InvalidRequestError):
    """A LoRA adapter cannot be unloaded while requests run with it: a conflict that passes (HTTP 409)."""


class EngineDeadError(KvyardError):
    """The engine loop has stopped; no more requests are accepted."""


class ConfigError(InvalidRequestError):
    """A deployment setting is unknown or has the wrong type; `param` names the offending key."""
