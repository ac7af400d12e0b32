"""One pool of two gloo rank processes for every ported upstream test (see pool.py)."""

import pytest

from upstream.pool import RankPool
from upstream.support import worker_setup, worker_teardown


@pytest.fixture(scope="session")
def pool(tmp_path_factory):
    p = RankPool(
        tmp_path_factory.mktemp("upstream-pool"),
        world_size=2,
        setup=worker_setup,
        teardown=worker_teardown,
    )
    yield p
    p.close()
