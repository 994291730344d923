"""mixrl: fully asynchronous RL for language models with mixed-precision samplers.

Every sampler group runs its own precision and engine; one trainer keeps its
own precision; off-policy corrections (``mixrl.corrections``) keep the updates
close to on-policy. The folders and what each may import: docs/architecture.md.

``import mixrl`` imports nothing and changes no global state: the entry points
(``mixrl.commands``, ``mixrl.runtime.run.train``, worker processes) quiet the
libraries they load (``mixrl.system.quiet``).
"""

__version__ = "0.1.0"
