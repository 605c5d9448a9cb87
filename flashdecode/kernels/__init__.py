"""Kernel backends: the protocol and registry (``base``), and one package per backend, imported on
first use (``base.get_backend``)."""
from .base import Backend, BackendError, LaunchArgs, get_backend, select

__all__ = ["Backend", "BackendError", "LaunchArgs", "get_backend", "select"]
