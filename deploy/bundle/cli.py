"""``kvhandoff bundle`` here and ``python3 -m deploy.bundle`` on the host.

  download --target NAME --wheels DIR          fetch the target's wheels (here)
  split    --target NAME --wheels DIR --parts DIR [--part-mib N]
  install  --parts DIR --site DIR [--wheels DIR] [--target NAME]
           join what has arrived, check it, install it (the host); exit 3 while parts
           are missing, naming them
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from deploy.bundle.parts import BundleError, PartsMissing, join, split
from deploy.bundle.wheels import download, install, load_target

#: One transfer to the GPU host carries 64 MiB, the tracked tree (~2.5 MiB) included.
DEFAULT_PART_MIB = 60
EXIT_MISSING = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bundle_command", required=True)
    dl = sub.add_parser("download", help="fetch a target's wheels (needs the registry)")
    dl.add_argument("--target", required=True)
    dl.add_argument("--wheels", type=Path, required=True)
    sp = sub.add_parser("split", help="pack a wheel folder into parts of one transfer each")
    sp.add_argument("--target", required=True)
    sp.add_argument("--wheels", type=Path, required=True)
    sp.add_argument("--parts", type=Path, required=True)
    sp.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB)
    ins = sub.add_parser("install", help="join the parts, check them, install (no registry)")
    ins.add_argument("--parts", type=Path, required=True)
    ins.add_argument("--site", type=Path, required=True)
    ins.add_argument("--wheels", type=Path, default=None,
                     help="where the joined wheels go (default: a temporary folder)")
    ins.add_argument("--target", default=None,
                     help="also import the target's modules from the site afterwards")


def run(args: argparse.Namespace) -> int:
    try:
        if args.bundle_command == "download":
            wheels = download(load_target(args.target), args.wheels)
            total = sum(w.stat().st_size for w in wheels)
            print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.wheels}")
        elif args.bundle_command == "split":
            load_target(args.target)
            m = split(args.wheels, args.parts, int(args.part_mib * 2**20), args.target)
            print(f"{len(m.wheels)} wheels, {m.bytes / 2**20:.1f} MiB in {len(m.pieces)} "
                  f"parts under {args.parts} ({', '.join(p.part for p in m.pieces)})")
        else:
            imports = load_target(args.target).imports if args.target else ()
            with tempfile.TemporaryDirectory() as tmp:
                wheel_dir = args.wheels or Path(tmp)
                manifest = join(args.parts, wheel_dir)
                fresh = install(manifest, wheel_dir, args.site, imports)
            print(f"bundle {manifest.target}: {len(manifest.wheels)} wheels "
                  f"{'installed into' if fresh else 'already in'} {args.site}")
    except PartsMissing as e:
        print(f"bundle: {e}", file=sys.stderr)
        return EXIT_MISSING
    except BundleError as e:
        print(f"bundle: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m deploy.bundle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
