"""Deployment speed: warm sites and a fast path for Flower's fixed waits.

:mod:`fedsgld.deploy.warm`  a site-side fork server that has already imported the heavy
    libraries (torch, numpy, scipy, flwr), reached through a ``flwr-clientapp`` shim placed
    first on the SuperNode's ``PATH`` (:mod:`fedsgld.deploy.shim`). Flower's own SuperNode
    and SuperExec run unchanged; every task still runs the submitted app bundle's code, in
    a fresh forked process (:mod:`fedsgld.deploy.warm_task`).
:mod:`fedsgld.deploy.fast`  ``fedsgld supernode`` / ``fedsgld superlink``: Flower's own
    SuperNode and SuperLink with their fixed sleeps and object-pull backoff shortened at
    run time (opt-in; exact flwr versions only, :mod:`fedsgld.deploy.releases`), plus the
    warm sites. Its parts: :mod:`~fedsgld.deploy.waits`, :mod:`~fedsgld.deploy.bundles`,
    :mod:`~fedsgld.deploy.launch`, and its options :mod:`~fedsgld.deploy.fast_options`.
:mod:`fedsgld.deploy.run`  ``flwr run`` whose exit status is the run's outcome;
    :mod:`fedsgld.deploy.export_sites` writes each site's data for a deployment.

Nothing is imported here: the shim is loaded on its own (standard library only) and must
start fast.
"""
