"""``python -m fedsgld.deploy supernode|superlink -- ...``: the fast path (see
:mod:`fedsgld.deploy.fast`), without the rest of the ``fedsgld`` command."""

from .fast import main

raise SystemExit(main())
