"""The exceptions of m3msa: one base type, m3msa.Error, and one subclass per m3msa::ErrorCode that
is also the matching built-in exception, so `except ValueError` catches a bad argument the way
Python callers expect while `except m3msa.Error` still catches everything the library raises."""

import builtins


class Error(RuntimeError):
    """A failure reported by m3msa, in C++ or in Python.

    Attributes:
        code: 'invalid_argument' (the caller broke the contract), 'unsupported' (valid, but not
            implemented by this backend or build), 'timeout' (a bounded wait expired) or
            'internal' (a bug, or a failed CUDA call).
        message: the message alone, naming the argument and the value (str(error) adds the code
            and, for C++ errors, the throw site).
        rank: the rank that failed, in multi-rank code; None otherwise.

    The instance raised is of the subclass for its code: InvalidArgumentError (a ValueError),
    UnsupportedError (a NotImplementedError), TimeoutError (a builtins.TimeoutError) or
    InternalError.
    """

    CODES = ("invalid_argument", "unsupported", "timeout", "internal")

    def __init__(self, text, code="internal", message=None, rank=None):
        super().__init__(text)
        self.code = code
        self.message = text if message is None else message
        self.rank = rank


class InvalidArgumentError(Error, ValueError):
    """code 'invalid_argument': a tensor, shape, dtype, device, stride or value the contract
    forbids; the message names the argument."""


class UnsupportedError(Error, NotImplementedError):
    """code 'unsupported': valid, but not implemented by this backend, build or configuration."""


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 (m3msa.TimeoutError on purpose)
    """code 'timeout': a bounded wait expired (a peer rank never arrived); .rank names it."""


class InternalError(Error):
    """code 'internal': a bug, or a failed CUDA / NCCL call."""


_BY_CODE = {"invalid_argument": InvalidArgumentError, "unsupported": UnsupportedError,
            "timeout": TimeoutError, "internal": InternalError}


def make_error(text, code="internal", message=None, rank=None):
    """The exception for an m3msa::Error (the compiled module raises what this returns)."""
    return _BY_CODE.get(code, InternalError)(text, code, message, rank)


def invalid(message):
    """An InvalidArgumentError whose text follows the C++ layout."""
    return InvalidArgumentError("m3msa: invalid argument: " + message, "invalid_argument", message)


def unsupported(message):
    return UnsupportedError("m3msa: unsupported: " + message, "unsupported", message)
