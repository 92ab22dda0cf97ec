"""DecodeWorker's peer pull methods (docs/design.md, "Peer pull"), apart from the handoff path
they share the reservation, the transfer and the commit with (decode_service/worker.py): the
puller's reserve_pull and fall_back, the holder's push_prefix.

A mixin of DecodeWorker only: it uses the worker's handoff table, receiver, KV config and
`_reserve`, which DecodeWorker defines.
"""

from __future__ import annotations

from pdserve.core.messages import KVReservation, WorkRequest
from pdserve.logging_setup import bind_request_id


class PeerPullMethods:
    """The Ray methods of a peer pull, on both sides."""

    async def reserve_pull(
        self, request: WorkRequest, pulled_blocks: int, deadline_s: float
    ) -> KVReservation | None:
        """A peer pull (docs/design.md): like reserve(), but the transfer takes only the
        prompt's blocks from this worker's own hits up to `pulled_blocks`, which a peer holding
        them pushes (push_prefix) and commits as a prefix; this worker then prefills the rest.
        Until `deadline_s` seconds from now; a pull that ends otherwise (expired, aborted by
        the peer, refused) falls back to prefilling from the own hits, as does one with nothing
        to pull (no missing_block_indices then). Tokens come out of stream()."""
        if pulled_blocks < 1:
            raise ValueError(f"pulled_blocks is {pulled_blocks}; a pull takes at least 1 block")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s is {deadline_s}; a pull needs time left")
        deadline_s = min(deadline_s, self._kv_config.reservation_timeout_s)
        await self._started()
        # Pulls move whole blocks between one-device workers; a tensor-parallel worker
        # answers as one without room, and the router prefills it there as usual.
        if request.request_id in self._aborted or self._ranked:
            return None
        handoff = self._handoffs.begin(
            request.request_id, len(request.prompt_token_ids), request.sampling.logprobs
        )
        handoff.pulled_blocks = pulled_blocks
        try:
            return await self._reserve(handoff, request, deadline_s)
        except BaseException:
            self._handoffs.end(handoff)
            raise

    async def push_prefix(
        self,
        request_id: str,
        prefix_token_ids: list[int],
        first_block: int,
        endpoint: str,
        transfer_id: str,
        deadline: float,
    ) -> int:
        """The holder's side of a peer pull: pushes this worker's cached blocks
        [first_block, len(prefix_token_ids) // block_size) of the prefix into the pull
        `transfer_id` another worker opened (reserve_pull), by `deadline` (unix time); the
        bytes sent. Raises PrefixNotHeld when it no longer caches the whole prefix."""
        from decode_service.prefix_push import PrefixNotHeld, push_prefix
        from kv_transfer.factory import make_sender

        runtime = await self._started()
        if runtime.rank_group is not None:  # its engine reads rank 0's KV heads only
            raise PrefixNotHeld(f"{self.worker_id} is tensor-parallel: it pushes no prefixes")
        if self._sender is None:  # made on the first pull: most workers never push
            self._sender = make_sender(self._kv_config, runtime.engine.kv_cache)
        with bind_request_id(request_id):
            sent = await push_prefix(
                runtime,
                self._sender,
                request_id,
                prefix_token_ids,
                first_block,
                endpoint,
                transfer_id,
                deadline,
            )
        return sent.bytes

    async def fall_back(self, request_id: str) -> None:
        """Ends the request's pull now (its peer was marked unhealthy): the transfer is
        fenced and the request prefills from this worker's own hits. Idempotent; a request
        whose pull already ended is left as it is."""
        runtime = await self._started()
        handoff = self._handoffs.by_request(request_id)
        if handoff is None or not handoff.pulled_blocks or not handoff.transfer_id:
            return
        if await self._on_receiver(self._receiver.abort, handoff.transfer_id):
            self._handoffs.end(handoff)
            await runtime.loop.acall(lambda: runtime.engine.fall_back(request_id))
