"""Finding and reading a model: the catalog, GGUF files, checkpoints, the loader and its progress."""
