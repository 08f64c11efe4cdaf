"""Errors raised for impossible configurations, before any process group or step exists."""


class MegatronConfigError(ValueError):
    """A configuration that cannot work.

    Messages name the argument, the value, the rule it breaks and what would work,
    so that the mistake is fixed before a cluster is spent on it.
    """


class MegatronCheckpointError(ValueError):
    """A checkpoint that cannot be used as asked: it says which file or tensor, what was found,
    what was expected and what would work, before anything of the running job is changed."""


class CheckpointMismatchError(MegatronCheckpointError):
    """The checkpoint is of another model, optimizer or data position than the running job."""


class UnsafeCheckpointError(MegatronCheckpointError):
    """The checkpoint's pickled data names a type that could run code when loaded; refused."""
