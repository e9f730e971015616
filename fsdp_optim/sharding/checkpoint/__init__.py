"""Checkpoints and state dicts of sharded models and optimizers: the package's face.

- ``save_checkpoint`` / ``load_checkpoint``: DCP checkpoints at any world size and plan (``_save``,
  ``_load``; the folder on disk, its manifest and atomic publish in ``_files``, checksums in
  ``_checksums``, what a load may unpickle in ``_serialization``);
- ``full_state_dict`` / ``load_full_state_dict``: plain full tensors (``_full_state``);
- ``export_hf`` / ``load_hf``: Hugging Face safetensors folders (``_hf``);
- ``register_state_dict_hooks`` / ``register_optimizer_hooks``: state-dict hooks (``_hooks``);
- the optimizer contracts checkpoints rely on: ``ShardedState``, ``OwnedState`` (``_state``).

See [Note: checkpoint layout] (``_state``) for what a checkpoint holds.
"""

from ._files import MANIFEST
from ._full_state import full_state_dict, load_full_state_dict
from ._hf import export_hf, load_hf
from ._hooks import register_optimizer_hooks, register_state_dict_hooks
from ._load import load_checkpoint
from ._save import save_checkpoint
from ._state import OwnedState, ShardedState, StateKind, model_state_dict

__all__ = [
    "MANIFEST",
    "OwnedState",
    "ShardedState",
    "StateKind",
    "export_hf",
    "full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "load_hf",
    "model_state_dict",
    "register_optimizer_hooks",
    "register_state_dict_hooks",
    "save_checkpoint",
]
