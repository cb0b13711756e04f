"""``python3 -m deploy.bundle``: the bundle's command line (``deploy.bundle.cli``)."""

import sys

from deploy.bundle.cli import main

if __name__ == "__main__":
    sys.exit(main())
