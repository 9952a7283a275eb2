"""``kvgate operator``: run the ExecutorPool operator (kopf) in this process.

Equivalent to ``kopf run -m kvgate.operator.handlers`` with the options below; kopf's liveness
endpoint answers on ``--liveness`` and leader election uses kopf peering (the KopfPeering or,
with ``--all-namespaces``, ClusterKopfPeering resource named by ``--peering``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging

import kopf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        metavar="NAMESPACE",
        help="watch ExecutorPools in this namespace (repeatable)",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch ExecutorPools everywhere"
    )
    parser.add_argument(
        "--peering",
        default="kvgate-operator",
        help="kopf peering object used for leader election (default: %(default)s)",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="run without peering (one operator replica only; for development)",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8081/healthz",
        help="liveness endpoint URL (default: %(default)s)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    # Importing the handlers registers them with kopf's default registry.
    importlib.import_module("kvgate.operator.handlers")

    kopf.configure(debug=args.verbose, verbose=args.verbose)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    asyncio.run(
        kopf.operator(
            clusterwide=args.all_namespaces,
            namespaces=args.namespaces or (),
            standalone=args.standalone,
            peering_name=None if args.standalone else args.peering,
            liveness_endpoint=args.liveness,
        )
    )
    return 0
