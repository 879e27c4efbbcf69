"""Memory planning before launch: what each part of a run needs per device, and the ``plan`` command."""
