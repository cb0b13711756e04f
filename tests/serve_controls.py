"""Request routers for the Ray tests' negative controls, imported by Serve's handles in
the Router replica (so a plain module, no pytest): Decode's own router with the
continuation's ``affinity`` dropped, so a parent's continuations are placed by room
alone (as before it existed), every other call routed as shipped."""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RunningReplica

from deploy.request_router import CapacityRouter


class CapacityRouterNoAffinity(CapacityRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            (pending_request.kwargs or {}).pop("affinity", None)
        return await super().choose_replicas(candidate_replicas, pending_request)
