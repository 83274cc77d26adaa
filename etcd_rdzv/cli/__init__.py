"""``etcd-rdzv``: the operator's command for rendezvous runs kept in etcd (``python -m etcd_rdzv``).

Modules: :mod:`.connect` (connection options, the command's deadline),
:mod:`.v2state` (``close`` of an etcd-v2 state; reading it is :mod:`etcd_rdzv.v2state`, the
restricted unpickler the backend uses too),
:mod:`.runs` (finding and reading runs), :mod:`.actions` (``close``, ``gc``),
:mod:`.grants` (``grant``, ``revoke``: a run's etcd user and role),
:mod:`.watching` (``watch``), :mod:`.render` (text output), :mod:`.main` (the
argument parser and the exit codes). Usage: docs/cli.md.
"""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]
