"""``python -m codecomplete.daemon``: the same as the ``codecomplete-daemon`` command."""

from .cli import main

raise SystemExit(main())
