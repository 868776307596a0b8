"""The memory layer: one device, one budget, and the weights' residency in it.

The device (backend, budget owner, arena, streams), the budget plan that splits it into
zones, the slots at stable addresses, the residency manager and its policies, the pinned
host store the page-ins copy from, and the meter that charges ORT's own memory.
"""

from .budget import ZonePlan, base_zones, describe_zones, plan_budget, smallest_budget
from .device import Device, cuda_available, weights_allowance
from .expert_pages import REBALANCE_STEPS, ExpertPages, InPlaceNode
from .host_split import NODE_SECONDS, PREFILL_TOKENS, HostSplit, StepWeight, host_rate, plan_host_split
from .host_store import HostStore, read_bytes
from .ort_memory import OrtMemoryMeter, SLACK
from .planning import plan_inputs, plan_or_explain
from .counters import Counters
from .residency import ResidencyManager
from .step_memory import StepMemoryShort, activation_shape, device_out_of_memory, is_out_of_memory, step_scratch

__all__ = ["NODE_SECONDS", "PREFILL_TOKENS", "REBALANCE_STEPS", "Counters", "Device", "ExpertPages", "HostSplit", "HostStore", "StepWeight", "host_rate",
           "plan_host_split", "InPlaceNode", "OrtMemoryMeter",
           "ResidencyManager", "SLACK", "StepMemoryShort",
           "ZonePlan", "activation_shape", "base_zones", "cuda_available", "describe_zones", "device_out_of_memory",
           "is_out_of_memory", "plan_budget", "plan_inputs", "plan_or_explain", "read_bytes", "smallest_budget",
           "step_scratch", "weights_allowance"]
