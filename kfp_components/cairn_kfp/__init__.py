"""Kubeflow Pipelines v2 components whose retries resume from their last cairn snapshot.

- :func:`component`: decorate a function into a KFP component whose ``ckpt`` parameter gets a
  :class:`cairn.state.Checkpointer` keyed on (job id, task name[, loop item]);
- :data:`train`, :data:`batch_inference`: ready components (state mode);
- :func:`run_command`: a container component running a command under ``cairn run`` (process
  mode, self-hosted KFP only);
- :func:`with_fallback`: the spot task with retries, then an on-demand fallback task that
  resumes the same key (:mod:`cairn_kfp.fallback`);
- :mod:`cairn_kfp.kubernetes`: kfp-kubernetes helpers (store access, spot nodes, deadline,
  retries, the process-mode label).

Importing this package imports kfp, never torch.
"""

from __future__ import annotations

from cairn_kfp.component import CairnComponent, component
from cairn_kfp.components import batch_inference, train
from cairn_kfp.container import call, run_command
from cairn_kfp.fallback import FallbackTasks, with_fallback
from cairn_kfp.images import DEFAULT_IMAGE

__all__ = ["DEFAULT_IMAGE", "CairnComponent", "FallbackTasks", "batch_inference", "call",
           "component", "run_command", "train", "with_fallback"]
