"""An offline install bundle for an air-gapped GPU host (issue 45).

Here, with a registry: ``kvhandoff bundle download`` fetches the wheels a named target
needs (``targets/<name>.txt``: exact pins, no dependency resolution, since the host's
own packages are part of the target), and ``kvhandoff bundle split`` packs them into
part folders that each fit one transfer (``part-01/`` ... with a manifest in every part).

On the host, with nothing of ours installed: ``python3 -m deploy.bundle install
--parts DIR --target SITE`` joins the parts that have arrived, checks every piece and
every wheel against the manifest, and installs the wheels into ``SITE`` with pip and no
index. It says which part is missing or corrupt and changes nothing until all check.

Standard library only: the host runs it before anything else is there.
"""

from deploy.bundle.parts import BundleError, Manifest, join, split

__all__ = ["BundleError", "Manifest", "join", "split"]
