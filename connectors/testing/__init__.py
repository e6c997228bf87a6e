"""The connector conformance kit, for this repository's connectors and third-party ones.

A connector's tests subclass ``ConnectorConformance`` and provide a ``source`` fixture
returning its Source over the 200 merchants of ``data`` (``data.table()``; ``data.SCHEMA``
the Arrow schema, ``data.DECLARED`` the same as a ``schemas:`` declaration) loaded into its
real server::

    import pytest
    from connectors.testing import ConnectorConformance, data

    class TestRedis(ConnectorConformance):
        unsupported = {"like": "no pattern match in RediSearch; the fabric applies it"}

        @pytest.fixture
        def source(self, redis_connection):
            redis_connection.load("merchants", data.table())
            return redis_connection.source("merchants")

The suite checks the contract's shape, the schema, statistics, watermark, full scans,
projection, 30 filter cases against plain-Python oracles (a filter claimed EXACT must be
exact; one not taken is re-applied), limit and order, hostile session values, the
unknown-column error, and that each scan reports its own ``request.metrics``
(``connectors.base.ScanMetrics``) when another scan of the same source runs meanwhile.
``fabric_scan`` runs a scan the way the planner and executor do.
Needs pytest (``agent-data-fabric[dev]``); ``docs/contributing.md`` walks through a
complete connector package using it.
"""

from connectors.testing import data
from connectors.testing.conformance import ConnectorConformance, fabric_scan, oracle_ids

__all__ = ["ConnectorConformance", "data", "fabric_scan", "oracle_ids"]
