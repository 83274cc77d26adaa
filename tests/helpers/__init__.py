"""Shared test helpers: real etcd versions, certificates, Docker, network namespaces, torchrun jobs.

``REPO_ROOT`` is the checkout's root. Test modules import these as ``from helpers.elastic import Job``
(tests/ is on ``sys.path`` because tests/conftest.py lives there).
"""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
