"""Errors a user can act on: the CLI prints them as one line and exits with code 2."""


class TfgraphError(Exception):
    """A problem with the user's input; the message names it and says what to do."""

    exit_code = 2


class ParityError(TfgraphError):
    """The exported artifact does not match eager PyTorch within tolerance."""

    exit_code = 1
