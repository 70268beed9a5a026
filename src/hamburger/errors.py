"""The one exception type for problems a user can fix (bad input, missing model, mismatched checkpoint)."""


class HamburgerError(Exception):
    """An error whose message is meant for the user; the CLI prints it without a traceback."""
