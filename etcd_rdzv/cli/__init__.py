"""``etcd-rdzv``: the operator's command for rendezvous runs kept in etcd (``python -m etcd_rdzv``).

Modules: :mod:`.connect` (connection options, the command's deadline), :mod:`.runs` (finding
and reading runs; an etcd-v2 state is read by :mod:`etcd_rdzv.v2state`, the restricted
unpickler the backend uses too), :mod:`.actions` (``close``, ``gc``), :mod:`.grants`
(``grant``, ``revoke``), :mod:`.watching` (``watch``), :mod:`.render` (text output),
:mod:`.main` (the argument parser and the exit codes). Usage: docs/cli.md.
"""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]
