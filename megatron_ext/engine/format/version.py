"""The checkpoint format's version: one number for the manifest, the rank reports and every tensor file's header."""

#: The checkpoint format's one version number (the manifest's and the rank reports' ``format_version``;
#: docs/FORMAT.md). Its own module so the manifest, the reports and the tensor files share it.
FORMAT_VERSION = 3
#: ``format_version`` in each tensor file's safetensors ``__metadata__``: the same version, as a
#: string because safetensors metadata values are strings.
HEADER_FORMAT_VERSION = str(FORMAT_VERSION)
