"""One module per `pyllama-kv` command, each with ``register(subparsers)`` and ``run(args)``.

A module imports only argparse-level things at the top; what the command needs (the engine, the
harness, numpy) is imported inside ``run``, so that ``pyllama-kv X`` loads only X's dependencies.
"""
