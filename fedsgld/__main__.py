"""``python -m fedsgld``: the ``fedsgld`` command (:func:`fedsgld.cli.commands.main`)."""

from fedsgld.cli.commands import main

raise SystemExit(main())
