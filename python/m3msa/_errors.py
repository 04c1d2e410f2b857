"""The one exception type of m3msa."""


class Error(RuntimeError):
    """A failure reported by m3msa, in C++ or in Python.

    Attributes:
        code: 'invalid_argument' (the caller broke the contract), 'unsupported' (valid, but not
            implemented by this backend or build), 'timeout' (a bounded wait expired) or
            'internal' (a bug, or a failed CUDA call).
        message: the message alone, naming the argument and the value (str(error) adds the code
            and, for C++ errors, the throw site).
        rank: the rank that failed, in multi-rank code; None otherwise.
    """

    CODES = ("invalid_argument", "unsupported", "timeout", "internal")

    def __init__(self, text, code="internal", message=None, rank=None):
        super().__init__(text)
        self.code = code
        self.message = text if message is None else message
        self.rank = rank


def invalid(message):
    """An Error with code 'invalid_argument' whose text follows the C++ layout."""
    return Error("m3msa: invalid argument: " + message, "invalid_argument", message)


def unsupported(message):
    return Error("m3msa: unsupported: " + message, "unsupported", message)
