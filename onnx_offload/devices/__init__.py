"""One model over several devices: a contiguous stage per device, each an OffloadSession
with its own budget owner, ledger and engine, the boundary values moved between them.

``balance`` picks the cuts, ``stages`` writes the stage models, ``moves`` carries the
values across, ``session.StagedSession`` runs and generates through the stages.
"""

from .balance import COMPUTE_TO_LINK, DeviceShare, StageSplit, split_stages
from .session import PER_DEVICE, StagedSession, check_devices
from .stats import StagedStats

__all__ = ["COMPUTE_TO_LINK", "DeviceShare", "PER_DEVICE", "StageSplit", "StagedSession", "StagedStats",
           "check_devices", "split_stages"]
