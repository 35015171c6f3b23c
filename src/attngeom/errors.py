"""Errors that attngeom raises on bad input. The CLI turns each into a one-line message and a
non-zero exit status; the Python API lets them propagate."""


class AttngeomError(Exception):
    """Base class: a problem with the user's input or environment, explained in the message."""


class ModelLoadError(AttngeomError):
    """The model spec could not be loaded (missing package, not a model, offline hub id, ...)."""


class UnsupportedArchitectureError(AttngeomError):
    """The model's architecture is not one attngeom captures exactly."""


class InputError(AttngeomError):
    """Bad text, tokens, options or data (empty text, too long, unknown metric, ...)."""


class OutputError(AttngeomError):
    """The output directory cannot be written."""


class TraceFormatError(AttngeomError):
    """A saved trace cannot be loaded: missing or damaged files, an unknown format version, or
    tensors whose shapes, types or values do not fit together."""
