"""The cluster core: the index of nodes and sandboxes in Redis, the nodes' heartbeats, the
scheduler and the gateway (see README.md). Imported only where a cluster is configured:
a single node needs none of it."""

from .errors import ClusterError, NoCapacity, SandboxLost, SandboxUnknown
from .heartbeat import Heartbeat, NodeReport
from .node import ClusterMember
from .placement import Demand, Strategy
from .registry import Binding, BindingState, NodeRecord, NodeState, Registry
from .store import ClusterStore, Keys

__all__ = ["Binding", "BindingState", "ClusterError", "ClusterMember", "ClusterStore",
           "Demand", "Heartbeat", "Keys", "NoCapacity", "NodeRecord", "NodeReport",
           "NodeState", "Registry", "SandboxLost", "SandboxUnknown", "Strategy"]
