"""Errors of the capture stage."""

from __future__ import annotations


class CaptureError(RuntimeError):
    """Base class for capture-stage errors."""


class UnsupportedModelError(CaptureError):
    """A GGUF architecture, RoPE variant or cache class this converter/capture does not handle."""
