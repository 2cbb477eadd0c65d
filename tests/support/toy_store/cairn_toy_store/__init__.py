"""A toy cairn store backend: ``toy://BUCKET/PREFIX``, objects as files below
``$CAIRN_TOY_STORE_ROOT/BUCKET``. For cairn's plug-in tests only (see ``pyproject.toml``)."""
