"""``python3 -m tools.gpu_probe``: the probe's command line (``tools.gpu_probe.cli``)."""

from __future__ import annotations

import sys

from tools.gpu_probe.cli import main

if __name__ == "__main__":
    sys.exit(main())
