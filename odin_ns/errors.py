"""One kind of error for bad input: it ends the program with one line that says what to do.

`OdinInputError` subclasses `SystemExit`, so `ns-train`, `ns-eval` and the torchrun workers print its message
(no traceback) and exit with status 1.
"""

from __future__ import annotations


class OdinInputError(SystemExit):
    """Bad input from the user (data, flags, environment): `odin: error: <what> (<what to do>)`."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(f"odin: error: {message}")
