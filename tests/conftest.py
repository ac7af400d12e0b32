import os
import sys
import warnings

warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
sys.path.insert(0, os.path.dirname(__file__))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: torch's intra-op threads (OpenMP, spinning while they wait) in
    # every worker and every rank they start slowed pure-Python tests 200x on 2 cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


@pytest.fixture
def tmp_root(tmp_path):
    """A scratch directory for simulated nodes' store roots (on tmpfs when available)."""
    return tmp_path
