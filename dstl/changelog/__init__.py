"""The log core: writers, storage, readers, the registry, handles, and the upload machinery."""
