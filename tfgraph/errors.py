"""Errors a user can act on: the CLI prints them as one line and exits with code 2."""


class TfgraphError(Exception):
    """A problem with the user's input; the message names it and says what to do."""

    exit_code = 2


class ParityError(TfgraphError):
    """The exported artifact does not match eager PyTorch within tolerance."""

    exit_code = 1


def first_line(exc: BaseException, *, named: bool = False, root: bool = False) -> str:
    """The first line of an exception's message, for one-line errors.

    ``named``: prefixed with the exception's type (``ValueError: …``). ``root``: of the
    innermost cause (exporters wrap the real error), skipping traceback lines.
    """
    if root:
        while exc.__cause__ is not None:
            exc = exc.__cause__
    for line in str(exc).strip().splitlines():
        line = line.strip()
        if not line or (root and line.startswith(("Traceback", "File ", "For more information"))):
            continue
        return f"{type(exc).__name__}: {line}" if named else line
    return type(exc).__name__
