"""The cluster scheduler: places sandboxes on nodes from their heartbeats and declares
nodes that stopped heartbeating dead (see README.md)."""

from .app import build_scheduler_app
from .metrics import SchedulerMetrics
from .monitor import Sweeper
from .service import Placement, PlacementRequest, Scheduler

__all__ = ["Placement", "PlacementRequest", "Scheduler", "SchedulerMetrics", "Sweeper",
           "build_scheduler_app"]
