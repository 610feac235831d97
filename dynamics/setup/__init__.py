"""A run's configuration (:class:`~dynamics.setup.config.RunConfig`, checkpoints, options) and
the defaults read off the instance (η, horizon). Imports ``learners`` and the rooms below it.
"""
