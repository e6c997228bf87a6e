"""``python -m fabric ...`` is the ``fabric`` command."""

from fabric.cli import main

raise SystemExit(main())
