"""The changelog: handles, registry, writer, storage, reader, upload and the file-system layout."""
