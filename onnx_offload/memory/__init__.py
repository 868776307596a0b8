"""The memory layer: one device, one budget, and the weights' residency in it.

The device (backend, budget owner, arena, streams), the budget plan that splits it into
zones, the slots at stable addresses, the residency manager and its policies, the pinned
host store the page-ins copy from, and the meter that charges ORT's own memory.
"""
