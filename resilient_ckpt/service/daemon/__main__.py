"""``python -m resilient_ckpt.service.daemon``: the same as ``resilient-ckpt serve``."""

import sys

from .main import main

sys.exit(main())
