"""Errors the user fixes in the run's configuration or files, not bugs.

The command-line entry points print such an error's message alone (no traceback) and
exit with code 2, as they do for a recipe that does not load. It is a ``ValueError``,
so library callers that catch those keep working.
"""


class ConfigError(ValueError):
    """The configuration does not fit what is on disk (e.g. a checkpoint of another model);
    the message names what differs and how to fix it."""
