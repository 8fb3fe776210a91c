"""Errors users see. The CLI prints their message and exits non-zero; nothing else is printed."""


class EsmcMlxError(Exception):
    """Base class: a problem with the user's input or environment, explained in the message."""


class ConvertError(EsmcMlxError):
    """A source or output that cannot be converted (missing, damaged, contradictory)."""


class QuantizeError(EsmcMlxError):
    """A quantization spec or group size that does not apply."""


class HubError(EsmcMlxError):
    """A Hub request that failed (auth, permissions, network, offline mode)."""
