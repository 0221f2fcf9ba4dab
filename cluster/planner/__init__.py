"""`pdserve plan`: the layout of N GPUs (colocated replicas or xPyD) with the best goodput for a
workload and SLOs, predicted by simulating the workers' steps from a step-time profile."""

from cluster.planner.plan import ATTAINMENT, LayoutPlan, RatePoint, goodput, layouts, plan
from cluster.planner.profile import StepProfile
from cluster.planner.simulate import Layout, Timing, simulate
from cluster.planner.workload import SLO, Request, Workload, requests

__all__ = [
    "ATTAINMENT", "SLO", "Layout", "LayoutPlan", "RatePoint", "Request", "StepProfile", "Timing", "Workload",
    "goodput", "layouts", "plan", "requests", "simulate",
]
