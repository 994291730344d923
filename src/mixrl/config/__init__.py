"""Typed configuration (pydantic v2; imports neither torch nor Ray).

- ``mixrl.config.run``: the whole run (``RunConfig``), TOML loading, ``--set``
  overrides, derived values, field-path error messages.
- ``mixrl.config.loss`` / ``mixrl.config.presets``: the loss and its named presets.
"""
