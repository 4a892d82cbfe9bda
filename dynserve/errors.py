"""The root of dynserve's exception tree.

    DynserveError
    ├── ModelLoadError          a weights file is missing, unreadable or of an unsupported kind
    ├── TokenizerError          a tokenizer cannot be built or a template cannot be rendered
    ├── InvalidRequestError     a request's parameters are wrong (the user's fault)
    └── CacheCapacityError      a request can never fit in the KV cache

Each error carries structured fields next to its message so callers (the gateway, the CLI) can map it
to a status code or exit code without parsing strings.
"""

from __future__ import annotations

__all__ = [
    "CacheCapacityError",
    "DynserveError",
    "InvalidRequestError",
    "ModelLoadError",
    "TokenizerError",
]


class DynserveError(Exception):
    """Root of every error dynserve raises on purpose."""


class ModelLoadError(DynserveError):
    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class TokenizerError(DynserveError):
    pass


class InvalidRequestError(DynserveError):
    """A request parameter is invalid; `param` names it."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CacheCapacityError(InvalidRequestError):
    """A request needs more KV blocks than the whole cache holds."""

    def __init__(self, message: str, *, num_blocks_needed: int, num_blocks_total: int) -> None:
        super().__init__(message, param="max_tokens")
        self.num_blocks_needed = num_blocks_needed
        self.num_blocks_total = num_blocks_total
