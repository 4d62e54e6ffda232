"""Shared core: base loading, config machinery, errors, atomic writes, the heads file format."""
