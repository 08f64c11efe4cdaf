"""Errors raised for impossible configurations, before any process group or step exists."""


class MegatronConfigError(ValueError):
    """A configuration that cannot work.

    Messages name the argument, the value, the rule it breaks and what would work,
    so that the mistake is fixed before a cluster is spent on it.
    """
