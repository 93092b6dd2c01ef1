"""FleetEngine: many LocalEngine replicas as Ray actors behind one Engine, routed by adapter affinity.

The service process keeps the whole Engine contract: `prepare_*` parse here against the same limits
as every replica, and `submit` routes the typed job to a replica and answers with a
`concurrent.futures.Future`. Each replica is a Ray actor owning its own LocalEngine (its own
residency tiers, KV cache and worker), so adding replicas adds adapter slots and compute.

Routing:
- a read-only adapter (an `AdapterSource`: checkpoint, catalog revision) has a home replica, where
  its requests find it hot. The router places a key it has not seen where free capacity is largest
  (fewest requests in flight per adapter slot; consistent hashing breaks ties), so a wave of cold
  adapters spreads in proportion to free capacity, and remembers it. When the home has
  `spill_inflight` sample requests in flight, new ones spill to the least-loaded replica (a hot
  policy is then served by several);
- a training adapter lives on one replica for its life: its fleet id maps to (replica, local id,
  the replica's incarnation); every op on it goes there;
- the bare base goes to the least-loaded replica.

Transport: read-only samples submitted together leave in one Ray call per replica (`run_batch`, a
streaming generator answering as they finish), so Ray's per-task cost does not grow with the
request count. A streamed sample (SampleJob.on_token / cancel) runs as its own streaming generator
(`stream`): token batches come back as drawn and go to on_token on the router's event loop; the
cancel event, seen there, reaches the replica, which stops the sample and frees its KV.
`cancel(future)` does the same for any sample.

Faults: replicas are Ray actors with `max_restarts`, so Ray replaces one that dies. A sample request
in flight on it is re-dispatched to another replica (same job, same seed: same tokens; a stream
passes on only the tokens its caller has not seen). A training adapter's live state dies with its
replica: ops on it fail with `AdapterLost` (retryable), and the service resumes the model from its
last saved state (see api/tinker/training.py). Replicas share nothing but the store: checkpoints and
catalog blobs on a path every node mounts.
"""

from mint_server.engine.fleet.engine import FleetEngine
from mint_server.engine.fleet.replica import ReplicaActor, ray_module
from mint_server.engine.fleet.routing import HashRing

__all__ = ["FleetEngine", "HashRing", "ReplicaActor", "ray_module"]
