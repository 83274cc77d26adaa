"""``python -m etcd_rdzv``: the ``etcd-rdzv`` command (:mod:`etcd_rdzv.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
