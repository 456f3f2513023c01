"""The contracts the engine is extended through: a ``Task`` (``task``, with ``register_task``), a
``Hook`` (``hooks``, with the ``trainer.hooks`` loader), a ``Part`` and the loop's ``Progress``
(``part``), and ``Cadence`` (every N steps or epochs, plus the end). Code outside the engine
implements these; the engine's own parts do too."""
