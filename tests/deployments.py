"""The old path of ``tests/helpers/deployments.py``: ``bench/cluster_phase.py`` imports
``cluster`` from here. Remove once the benchmark imports ``tests.helpers.deployments``."""

from tests.helpers.deployments import cluster

__all__ = ["cluster"]
