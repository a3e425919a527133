"""Scale-out of the simulator's client training: shards of a server step run elsewhere.

Above fedvox.fl, beside fedvox.deploy: `shards` cuts a step's jobs and reassembles the
results (no Ray); `ray` (the only module that imports Ray, extra `fedvox[ray]`) runs the
shards on Ray actors. The event loop, aggregation, privacy and checkpoints stay in the driver.
"""

from fedvox.scale.config import BackendConfig
from fedvox.scale.shards import assemble, cut

__all__ = ["BackendConfig", "assemble", "cut"]
