"""Deployment speed: warm sites and a fast path for Flower's fixed waits.

:mod:`fedsgld.deploy.warm`  a site-side fork server that has already imported the heavy
    libraries (torch, numpy, scipy, flwr), reached through a ``flwr-clientapp`` shim placed
    first on the SuperNode's ``PATH``. Flower's own SuperNode and SuperExec run unchanged;
    every task still runs the submitted app bundle's code, in a fresh forked process.
:mod:`fedsgld.deploy.supernode`  ``fedsgld supernode``: Flower's own SuperNode with its
    fixed sleeps and object-pull backoff shortened at run time (opt-in; exact flwr
    versions only), plus the warm sites.

Nothing is imported here: the shim imports only :mod:`fedsgld.deploy.warm` (standard
library only) and must start fast.
"""
