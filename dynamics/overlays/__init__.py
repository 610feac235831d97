"""Theory beside a run.

- ``finetune``: the rank-1 theory lines from each run's own start (ODE, corrected map, band,
  escape line);
- ``committee``: the committee-machine ODE and diffusion beside a network learner;
- ``assembly``: the trajectory of rank-1 runs from either engine's records, lines attached;
- ``audit``: each theory line against the SGD mean from the same starts.

Imports ``measures`` and the rooms below it, and ``hermite``.
"""
