"""The KV core: a model, a context (the one owner of the cells and of the table of what each
sequence holds), sequences (handles into their context), spans (compact copies of cells in host
memory) and llama.cpp's saved-state format (parsed, checked and digested, never trusted).

May import: ``_native`` (the C boundary), ``modelfile`` (the GGUF reader, validation, vetting),
``config``, ``limits``, ``errors``. Imported by everything above it."""
