"""The read side: open a committed checkpoint without an engine, read its files, verify and inspect.

Imports ``format/`` and the shared modules, never ``save/``."""
