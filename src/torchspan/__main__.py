"""``python -m torchspan`` runs the command-line interface."""

from torchspan.cli import main

raise SystemExit(main())
