"""What the plugin says when it cannot work with this install: :class:`EtcdRdzvPluginError` and the
torch version it names.

Its own room so that a handler module (``dynamic/state.py``) can raise it without importing
:mod:`etcd_rdzv.plugin`, which imports the handlers' creators (no import circle). No torch import.
"""

from __future__ import annotations

import sys

__all__ = ["EtcdRdzvPluginError", "torch_version"]


class EtcdRdzvPluginError(ImportError):
    """The plugin cannot work with this install: its dependencies could not be imported when a
    handler was created, or torch's handler registry does not have the shape the plugin expects."""


def torch_version() -> str:
    """The installed torch's version, without importing torch ("(version unknown)" if not found)."""
    torch = sys.modules.get("torch")
    found = getattr(torch, "__version__", None)
    if found:
        return str(found)
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:
        return "(version unknown)"
