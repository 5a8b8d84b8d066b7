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


# Each part of porter raises its own subclass; all live here so the taxonomy is read in one place
# (docs/architecture.md). Some also derive from ValueError / RuntimeError for code that catches those.


class ConfigError(PorterError, ValueError):
    """A config field is missing, of the wrong type or impossible, or the architecture (model_type) has no
    converter (the message names the field)."""


class LayoutError(PorterError, ValueError):
    """A tensor is missing, unexpected or of the wrong shape (the message names it)."""


class SourceError(PorterError, ValueError):
    """The source cannot be used (the message names the file and what to do)."""


class MalformedSafetensors(PorterError):
    """A safetensors file that cannot be read as one (the message names the file and what to do)."""


class PrequantizedError(PorterError, ValueError):
    """A quantized source the converter cannot read (the message names the field or tensor)."""


class MXFP8Error(PorterError, ValueError):
    """Bad input for MXFP8 quantization (names the tensor)."""


class ProduceError(PorterError):
    """A source tensor does not hold what the plan expects (the message names it)."""


class ManifestError(PorterError, ValueError):
    """porter.json is missing, not JSON, or not a porter artifact manifest (the message names the file)."""


class ConvertError(PorterError):
    """Bad options or output folder for a conversion (the message says what to do)."""


class InspectError(PorterError, ValueError):
    """The folder cannot be inspected (the message names the file)."""


class VerifyInputError(PorterError, ValueError):
    """Bad input to verify (missing dir, not an artifact, reference not found): CLI exit 2."""


class LoadError(PorterError, ValueError):
    """The path is not a loadable porter artifact / checkpoint of a supported architecture (the message
    says why)."""


class PlacementError(LoadError):
    """The model does not fit the given devices, or the device_map is malformed (one line says why)."""


class BackendUnavailable(PorterError, RuntimeError):
    """The requested MoE backend cannot run here (the message names the device/package and what to do)."""


class MoeNumericsError(PorterError, ValueError):
    """An unknown or impossible moe_numerics choice."""


class OutputFolderError(PorterError):
    """The output folder cannot be written safely (the message names the path and what to do)."""


class DeviceError(PorterError, ValueError):
    """A device or dtype argument that this machine cannot honour (no CUDA, no such GPU, not a dtype)."""


class TextError(PorterError, ValueError):
    """A tokenizer / chat template / generation_config file or a text argument that cannot be used."""
