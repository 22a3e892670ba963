"""Errors of the capture stage."""

from __future__ import annotations

from kvformat import KVSnapError


class CaptureError(KVSnapError, RuntimeError):
    """Base class for capture-stage errors (a `kvformat.KVSnapError`)."""


class UnsupportedModelError(CaptureError):
    """A GGUF architecture, RoPE variant or cache class this converter/capture does not handle."""


class ModelFolderError(CaptureError):
    """A model folder that does not load: the message names the file that fails."""


class UnknownTaskError(CaptureError, ValueError):
    """A benchmark task name `capture.ruler` does not generate."""
