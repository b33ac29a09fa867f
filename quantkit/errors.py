"""Typed errors. Each message is one line naming the file and tensor, the rule broken, and the fix.

The CLI maps every QuantkitError to that one line and exit code 1 (set QUANTKIT_DEBUG=1 for the
traceback); anything else is a bug and keeps its traceback.
"""


class QuantkitError(Exception):
    """Base class: a problem with the user's input or environment, not a bug in quantkit."""


class ConfigError(QuantkitError):
    """config.json, a recipe or a preset is missing, malformed or unsupported."""


class CheckpointError(QuantkitError):
    """A shard, the index or a tensor is missing, corrupt or contradicts the config."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        where = ": ".join(x for x in (file, tensor) if x)
        super().__init__(f"{where}: {message}" if where else message)
        self.file = file
        self.tensor = tensor


class OutputError(QuantkitError):
    """The output folder exists, the disk is too small, or a resume does not match."""


class IntegrityError(QuantkitError):
    """A finished output differs from its manifest, or a convert into it did not finish."""


class LockedError(OutputError):
    """Another live quantkit process owns the output folder."""
