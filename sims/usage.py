"""The error the command-line tools raise for a bad value, said in the words of the option."""


class UsageError(ValueError):
    """A bad command-line value, said in the words of the option."""
