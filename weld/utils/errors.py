"""User-facing errors.

`WeldError` is what the CLI prints as one line (no traceback) and what the server turns into an
OpenAI-shaped error. Subclasses say which kind of mistake it was.
"""


class WeldError(Exception):
    """An error caused by the user's input or environment, with a message meant for them."""


class ModelNotFoundError(WeldError, FileNotFoundError):
    """The model path or hub id does not lead to a model."""


class UnsupportedModelError(WeldError, ValueError):
    """The model is readable but weld does not implement its architecture or format."""


class InvalidInputError(WeldError, ValueError):
    """A request (prompt, sampling parameters) is invalid."""
