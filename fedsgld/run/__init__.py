"""The run around the maths, shared by both transports (the in-process engine and the
Flower ServerApp), top-down:

* :mod:`~fedsgld.run.lifecycle`: :class:`~fedsgld.run.lifecycle.RunLifecycle`, one run from
  its directory to its results (resolve, resume, charge, checkpoint, loop, finish);
* :mod:`~fedsgld.run.resume`: opening a run directory, resuming its ledger safely;
* :mod:`~fedsgld.run.layout`: the files of a run directory;
* :mod:`~fedsgld.run.progress`: the progress display;
* :mod:`~fedsgld.run.recalibration`: private temperature scaling inside the budget;
* :mod:`~fedsgld.run.evaluation`: what travels between the layers: a model's
  :class:`~fedsgld.run.evaluation.Evaluation` and the run's
  :class:`~fedsgld.run.evaluation.RunResult`;
* :mod:`~fedsgld.run.outputs` and :mod:`~fedsgld.run.blocks`: results.json's document;
* :mod:`~fedsgld.run.results`: the result directory's files (results.json, report.md, plots).
"""
