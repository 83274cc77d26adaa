"""The harness shared by the demo and the test suite: local torchrun agents and a training job.

:mod:`.agents` (``LocalAgent``, ``torchrun_command``, ``tagged_pids``,
``summarize``) and :mod:`.train` (the elastic training script, run under torchrun
as ``-m etcd_rdzv.testing.train`` or by path, and the reader of its step log).
Importing this package imports nothing else; neither module imports torch at
import time except :mod:`.train` when it runs.
"""
