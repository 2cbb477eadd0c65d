"""Training-framework integrations: resume Lightning and Hugging Face training from cairn.

Each integration is a small module that imports its framework only when imported itself:

- :mod:`cairn.integrations.lightning`: :class:`~cairn.integrations.lightning.CairnCheckpoint`,
  a ``lightning.pytorch.Callback`` (``pip install 'cairn-resume[lightning]'``).
- :mod:`cairn.integrations.huggingface`: :func:`~cairn.integrations.huggingface.train` and
  :class:`~cairn.integrations.huggingface.CairnCallback` for ``transformers.Trainer``
  (``pip install 'cairn-resume[huggingface]'``).

Both snapshot through :class:`cairn.state.Checkpointer`: tensors as raw bytes with a typed
header and the framework's loop state as JSON, never a pickle.
"""

from __future__ import annotations
