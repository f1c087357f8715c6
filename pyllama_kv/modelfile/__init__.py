"""Model files as untrusted input: the one GGUF reader (``gguf``), the static validation of what the
pinned loader asserts on (``validate``), the vetting of other architectures in a child process
(``vetting``), the catalogue of models from the package index (``catalogue``), downloads and file
hashes (``download``, ``filehash``).

May import: ``_native`` (vetting loads the library in its child), ``config``, ``limits``,
``errors``; ``vetting`` runs ``core.model`` in its child process only. Imported by ``core`` and the CLI."""
