"""The ``ragbudget`` command line: one module per command group, each with ``register(sub)``."""
