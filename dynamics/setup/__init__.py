"""What a run is.

- ``config``: :class:`~dynamics.setup.config.RunConfig`, the settings every engine and learner
  share, and its checkpoints;
- ``defaults``: the default η and horizon read off the instance.

Imports ``learners`` and the rooms below it.
"""
