"""Weight sync: Megatron shards → the rollout engines after every update, checked every time.

Every trainer rank calls `WeightSender.push` (sender.py); its leader sends the buckets through
the pipeline (pipeline.py) over a link (link.py) by one of the transports (transports.py:
broadcast, colocated, routed); the engine's process calls `WeightReceiver.receive`
(receiver.py); the driver runs both and the parity gate (driver.py, parity.py). Other modules:
wire (buckets, pack/unpack, checksums), channel (the gloo group and store), shared_export
(colocated: every rank writes its shards into the shared bucket), cuda_ipc, routing (routed:
each engine worker's own slices), plan (sync.apply in_place: where each HF slice lands).

The input is the bridge's export (or any buckets: pipeline.BucketSender), or, for
shared_export, the bridge's plan and segments; nothing here knows Megatron's layout. The longer
story: docs/sync.md (and docs/sync-routing.md).
"""


from mrl.sync.channel import SyncEndpoint
from mrl.sync.parity import ParityError
from mrl.sync.receiver import WeightReceiver
from mrl.sync.sender import WeightSender
from mrl.sync.transports import TRANSPORTS
from mrl.sync.wire import Bucket, SyncError, WeightLoadError, WeightUpdateReport

__all__ = ["TRANSPORTS", "Bucket", "ParityError", "SyncEndpoint", "SyncError", "WeightLoadError", "WeightReceiver",
           "WeightSender", "WeightUpdateReport"]
