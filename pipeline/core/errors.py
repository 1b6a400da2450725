"""The error type for bad input that the CLI reports in one message with exit code 2."""


class InputError(ValueError):
    """Bad input (params, paths, models, corpus, queries): the message names the cause and the fix."""
