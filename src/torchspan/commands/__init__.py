"""One module per ``torchspan`` subcommand; each has ``register(subparsers)``."""
