"""The on-disk format, shared by the save and the read side: names, the manifest and its
validation, the catalog of committed checkpoints, the safetensors files and the sidecar codec.

Imports nothing from ``save/`` or ``read/``."""
