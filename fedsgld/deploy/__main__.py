"""``python -m fedsgld.deploy supernode|superlink -- ...``: the fast path (see
:mod:`fedsgld.deploy.fast`), without the rest of the ``fedsgld`` command (what ``fedsgld
supernode`` execs, to keep a site's process small).
``python -m fedsgld.deploy run APP CONNECTION ...``: ``flwr run`` whose exit status is
the run's outcome (:mod:`fedsgld.deploy.run`); documented as ``fedsgld deploy run``."""

import sys

# only the module that runs is imported: the fast path's site process stays small
if sys.argv[1:2] == ["run"]:
    from fedsgld.deploy.run import main
else:
    from fedsgld.deploy.fast import main

raise SystemExit(main())
