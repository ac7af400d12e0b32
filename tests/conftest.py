import os
import sys
import warnings

warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture
def tmp_root(tmp_path):
    """A scratch directory for simulated nodes' store roots (on tmpfs when available)."""
    return tmp_path
