"""The rank side of ``tessera train``: what runs on each rank the launcher (:mod:`tessera.launch`) started.

- :mod:`.run`: a rank's entry point (parses the config once, trains, reports how it ended);
- :mod:`.trainer`: the run (set-up, restore, the loop, checkpoints); :mod:`.step`: one step and its losses;
- :mod:`.report`: metrics records and the end-of-run summary; :mod:`.metrics`: the log, progress and plots;
- :mod:`.build`: the model and optimizer a config describes; :mod:`.data`: its data.
"""
