"""The one exception type users see: the CLI prints it as a single line and exits 2."""


class QwcError(Exception):
    """A problem with the user's input or environment, described in one line."""

    exit_code = 2
