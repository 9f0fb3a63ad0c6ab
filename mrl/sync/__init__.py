"""Weight sync: Megatron shards → the rollout engines after every update, checked every time.

Every trainer rank calls `WeightSender.push` (sender.py); the engine's process calls
`WeightReceiver.receive` (receiver.py); the driver runs both and the parity gate (driver.py,
parity.py). Modules: wire (buckets, pack/unpack, checksums), channel (the transport), sender,
receiver, shared_export (colocated: every rank writes its shards into the shared bucket), cuda_ipc,
routing (routed: each engine worker's own slices), parity, driver, plan (sync.apply in_place:
where each HF slice lands in the engine). The input is the bridge's export (or any buckets:
sender.BucketSender), or, for shared_export, the bridge's plan and segments; nothing here knows
Megatron's layout.

The bridge's export (mrl/bridge/export.py) assembles HF tensors bucket by bucket on a leader rank,
which hands each bucket to the engines over a *channel*: a gloo group of 1 + N members (the leader
is member 0, engine i is member i + 1) rendezvousing on a TCPStore that engine 0 hosts (the hub;
engines 1..N-1 are told its endpoint and their index, and join it as store clients). One export
feeds every engine: per bucket the leader broadcasts a JSON header (names, shapes, dtypes, byte
offsets, checksums) and then the bytes to all engines at once:

- "broadcast": the bytes go through the channel itself, and every pipeline stage has its own
  leader and channel, so stages export and send in parallel (the engines may sit on other nodes);
- "colocated": one leader (global rank 0) for the whole model; the bytes are written once into a
  shared-memory file that every engine maps (same node). When every trainer rank sees the
  leader's /dev/shm and the engine takes the bytes as they are (a CPU engine, no FP8), each rank writes
  its own shards into that file (shared_export.py: no gather to the leader, which only checksums
  and announces the bucket; the same two files serve every push, each process keeping its mapping);
  otherwise the leader gathers and packs. The leader unlinks each file's name once every
  engine has loaded it (a barrier), or at the end after a failure. When
  the engines declare a CUDA device and see the GPU that holds the export's buckets, the bucket is
  packed in GPU memory instead and each engine's processes map it through CUDA IPC handles, one
  per open (cuda_ipc.py): no host copy.
  An engine that loads in other processes (vLLM's workers: `load_shared`) is handed the header and
  its workers map the bytes themselves: nothing is pickled into a message to them, and each worker
  of a TP engine reads only the slices its sync plan copies.

- "routed": as broadcast, but the channel carries only the headers; each engine worker receives
  just the slices of each tensor its in-place plan copies, point to point from the stage's leader
  over a gloo group of the leader and that engine's workers (routing.py; sync.apply in_place).

A GPU's buckets go on the broadcast wire from one pinned host buffer (sender.Staging). An engine
that declares `quantization: "fp8"` (DeepSeek's block FP8) gets each bucket quantised where it was
made (mrl.quant.fp8.quantize_pairs): FP8 weights and float32 scales travel as they are.

The leader pipelines: its calling thread exports bucket k + 1 (the export's collectives) while a
sender thread packs and sends bucket k (at most two buckets, plus the tensor being packed, alive);
the engines receive the next bucket while loading one (a thread per channel).

Each engine compares each received tensor's checksum with the sender's, so a failed parity check
can name the first tensor that arrived different (the driver checks every engine's report and
runs the parity gate on each, naming the engine). Every wait has a timeout, and its error names
the rank, the pipeline stage, the bucket and the tensors it was waiting for; a peer that dies
closes its sockets, which fails the wait at once instead of hanging (with several engines the
sender then names the engine whose port refuses connections). An engine that fails while
loading (its load_weights names the tensor by raising WeightLoadError) writes the error under
`{sync_id}/error` in the hub's store; each leader looks there before every bucket, stops sending,
and sends the end marker with the error ("abort"). Every engine answers the end marker in turn
(a broadcast rooted at each), so every sender raises the first engine's error (naming that
engine) within seconds, and every engine hears the others' answers: an engine that loaded
everything still reports the update failed when another engine did.
"""


from mrl.sync.channel import SyncEndpoint
from mrl.sync.parity import ParityError
from mrl.sync.receiver import WeightReceiver
from mrl.sync.sender import TRANSPORTS, WeightSender
from mrl.sync.wire import Bucket, SyncError, WeightLoadError, WeightUpdateReport

__all__ = ["TRANSPORTS", "Bucket", "ParityError", "SyncEndpoint", "SyncError", "WeightLoadError", "WeightReceiver",
           "WeightSender", "WeightUpdateReport"]
