"""Cluster descriptions: device catalogue, cluster files, and detection of the local machine."""

from tessera.cluster.catalog import CATALOG, DeviceType, lookup
from tessera.cluster.spec import Cluster, ClusterError, Link, Node

__all__ = ["CATALOG", "Cluster", "ClusterError", "DeviceType", "Link", "Node", "lookup"]
