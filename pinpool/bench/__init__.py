"""The lab beside the library: ``pinpool bench``'s harness, its staging workload, the CLI and plots.

Nothing in ``pinpool``'s core imports this package; sampling, memcache and the engine add
their workloads through the ``pinpool.bench`` entry-point group (see pyproject.toml).
"""
