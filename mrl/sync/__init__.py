"""Weight sync: Megatron shards → the rollout engines after every update, checked every time.

Every trainer rank calls `WeightSender.push` (sender.py); the engine's process calls
`WeightReceiver.receive` (receiver.py); the driver runs both and the parity gate (driver.py,
parity.py). Modules: wire (buckets, pack/unpack, checksums), channel (the transport), sender,
receiver, parity, driver, plan (sync.apply in_place: where each HF slice lands in the engine). The input is the bridge's export; nothing here knows Megatron's layout.

The bridge's export (mrl/bridge/export.py) assembles HF tensors bucket by bucket on a leader rank,
which hands each bucket to the engine over a *channel*: a two-member gloo group (leader, engine)
rendezvousing on a TCPStore that the engine hosts. Per bucket the leader sends a JSON header
(names, shapes, dtypes, byte offsets, checksums) and then the bytes:

- "broadcast": the bytes go through the channel itself, and every pipeline stage has its own
  leader and channel, so stages export and send in parallel (the engine may sit on another node);
- "colocated": one leader (global rank 0) for the whole model; the bytes are written once into a
  shared-memory file that the engine maps (same node; on GPUs this is the place of CUDA IPC).

The engine compares each received tensor's checksum with the sender's, so a failed parity check
can name the first tensor that arrived different. Every wait has a timeout, and its error names
the rank, the pipeline stage, the bucket and the tensors it was waiting for; a peer that dies
closes its sockets, which fails the wait at once instead of hanging. An engine that fails while
loading (its load_weights names the tensor by raising WeightLoadError) writes the error under
`{sync_id}/error` in its store; each leader looks there before every bucket, stops sending, and
gets the same error as the answer to its end marker, so every sender raises it within seconds.
"""


from mrl.sync.channel import SyncEndpoint
from mrl.sync.parity import ParityError
from mrl.sync.receiver import WeightReceiver
from mrl.sync.sender import TRANSPORTS, WeightSender
from mrl.sync.wire import Bucket, SyncError, WeightLoadError, WeightUpdateReport

__all__ = ["TRANSPORTS", "Bucket", "ParityError", "SyncEndpoint", "SyncError", "WeightLoadError", "WeightReceiver",
           "WeightSender", "WeightUpdateReport"]
