"""The launcher side of ``tessera train``: parse the config once, check it before any process starts
(:mod:`~tessera.launch.preflight`), start the ranks through torchrun (:mod:`~tessera.launch.jobs`,
:mod:`~tessera.launch.torchrun`) or one job per fault-tolerant group (:mod:`~tessera.launch.group_jobs`),
claim the run directory (:mod:`~tessera.launch.rundir`) and explain a failure (:mod:`~tessera.launch.failures`).

It never imports the rank side (:mod:`tessera.train`): the ranks it starts run that.
"""
