"""Running a config: which engine takes it (:mod:`~dynamics.engines.choice`), what it costs
(:mod:`~dynamics.engines.budget`), the run resolved once (:mod:`~dynamics.engines.resolve`)
and ``simulate`` itself with the full engine (:mod:`~dynamics.engines.engine`). The top room:
imports ``reduced``, ``setup`` and everything below; nothing in ``dynamics`` imports it.
"""
