"""porter's one error taxonomy.

A `PorterError` is a user-facing problem with the input (a file, tensor, config field or option): the CLI
prints its one-line message and exits 2. Anything else that escapes is an internal error: the CLI exits 3,
asks for a report, and shows the traceback with `-v`. `porter verify` exits 1 only for "not faithful".
Every module raises subclasses of `PorterError` for bad input, never a bare ValueError.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_NOT_FAITHFUL = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class PorterError(Exception):
    """Bad input. The message is one line naming the file, tensor or field and what to do."""

    exit_code = EXIT_BAD_INPUT


class DeviceError(PorterError, ValueError):
    """A device or dtype argument that this machine cannot honour (no CUDA, no such GPU, not a dtype)."""


class TextError(PorterError, ValueError):
    """A tokenizer / chat template / generation_config file or a text argument that cannot be used."""
