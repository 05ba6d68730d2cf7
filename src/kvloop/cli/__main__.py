"""``python -m kvloop.cli``: the same as the ``kvloop`` command."""

from kvloop.cli.main import main

raise SystemExit(main())
