"""`python -m dynserve.operator`: the operator (what the Helm chart's Deployment runs).

    python -m dynserve.operator [--namespace NS ...] [--metrics-port 8080] [--health-port 8081]
                                [--peering NAME | --standalone] [--kubeconfig FILE] [--context NAME]

Watches DynServeDeployments and DynServePools in the namespaces given (all, without one), serves its
metrics at `:METRICS_PORT/metrics` and its liveness at `:HEALTH_PORT/healthz`. With several replicas, kopf's
peering `NAME` keeps one active, the one of highest priority (each process draws its own at random, as equal
priorities would pause them all); the others wait until it goes. The chart creates the peering object.
"""

from __future__ import annotations

import argparse
import logging
import random

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dynserve.operator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", action="append", default=[], help="watch this namespace (repeatable); "
                        "default: all")
    parser.add_argument("--metrics-port", type=int, default=8080)
    parser.add_argument("--health-port", type=int, default=8081)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--peering", default="dynserve-operator", help="kopf peering name (leader election)")
    group.add_argument("--standalone", action="store_true", help="no peering: the only operator")
    parser.add_argument("--priority", type=int, default=None, help="peering priority [default: random]")
    parser.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG or ~/.kube/config, else in-cluster")
    parser.add_argument("--context", default=None)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import kopf
    from prometheus_client import start_http_server

    from dynserve.operator import handlers
    from dynserve.operator.kube import KubeClient
    from dynserve.operator.metrics import REGISTRY

    handlers.CLIENT["client"] = KubeClient.connect(kubeconfig=args.kubeconfig, context=args.context)
    start_http_server(args.metrics_port, registry=REGISTRY)
    priority = args.priority if args.priority is not None else random.SystemRandom().randrange(1, 2**31)
    kopf.run(clusterwide=not args.namespace, namespaces=args.namespace, standalone=args.standalone,
             peering_name=None if args.standalone else args.peering, priority=priority,
             liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz")


if __name__ == "__main__":
    main()
