"""The Ray Serve request router of `qwc serve --replicas` (runtime/replicas.py): a request
goes to the replica its prefix key went to before unless that one is busy or gone, else to
the least loaded (runtime/affinity.py). A module of its own because it subclasses Ray's
router, so importing it needs `qwc[ray]`."""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .affinity import Homes, rank


def _key(pending_request: PendingRequest | None) -> str | None:
    """The prefix key the ingress passes first (Ingress.__call__); control calls have none."""
    args = pending_request.args if pending_request is not None else []
    return args[0] if args and isinstance(args[0], str) else None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs):
        self.homes = Homes()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        load = {rid: cache.get(r.replica_id) for rid, r in by_id.items()}
        return [[by_id[rid] for rid in tier] for tier in rank(self.homes.get(_key(pending_request)), sorted(by_id), load)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.homes.set(_key(pending_request), replica_id.unique_id)
