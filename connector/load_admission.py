"""When one more asynchronous load may start: the loads vLLM has not yet run must fit the device cache.

vLLM (0.32 to 0.34) admits an async load against its own estimate of what the loads already admitted
still need, and that estimate caps a sliding-window group's count at its admission cap while counting
the window's null placeholders against it: for a loaded request past its window it reads 0 where the
next chunk needs a block per sliding-window group. Its full-sequence check, for its part, compares one
request's need with all free blocks, not with what the other loads leave. Loads admitted together can
then hold all but a block or two, each waiting for blocks the others hold; a request waiting for its
load cannot be preempted, and with none running the engine steps for ever (README, "Device KV
headroom"). A failed load at the head of vLLM's queue stalls it the same way.

So kvscope starts a load only while the requests whose loads vLLM has not yet run, this one included,
fit the device cache even at their largest: each of them alone then finds its blocks once the running
requests are gone, the head of the queue first. At their largest: every block a request's tokens span in
each full-attention and Mamba group; in a sliding-window group no more than vLLM's own per-request cap
for it (`max_admission_blocks_per_request`: the window plus the tokens in flight; vLLM frees the blocks
behind the window before it allocates a chunk, so a request never holds more, and every check of vLLM's
counts the group at most that). The bound is never below what vLLM asks, and only serialises loads when
the device cache is nearly full. A load that must wait is deferred (vLLM asks again next step), and the
loads behind it wait too, so none overtakes it.

Pure: request ids and token counts in, no vLLM types.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .groups import GroupKind, GroupLayout


def request_blocks_bound(layouts: Iterable[GroupLayout], num_tokens: int, lookahead_tokens: int = 0,
                         window_caps: Mapping[int, int] | None = None) -> int:
    """At most how many device blocks a request of ``num_tokens`` holds and asks for, over all groups,
    from its load until it first runs: every block its tokens (and ``lookahead_tokens`` drafts) span in
    each group, a sliding-window group no more than its cap in ``window_caps`` (group index -> blocks:
    vLLM's `max_admission_blocks_per_request`, and the drafts' slots; a group without one counts whole),
    and a Mamba group's draft states besides."""
    tokens = num_tokens + lookahead_tokens
    total = 0
    for layout in layouts:
        blocks = -(-tokens // layout.block_size)
        if layout.kind is GroupKind.MAMBA:
            blocks += lookahead_tokens  # a state block per draft token at most
        elif window_caps and layout.kind is GroupKind.SLIDING_WINDOW and layout.index in window_caps:
            # (vLLM's cap counts the tokens in flight, not the drafts' slots beside them: those too)
            blocks = min(blocks, window_caps[layout.index] - (-lookahead_tokens // layout.block_size))
        total += blocks
    return total


@dataclass(slots=True)
class Deferral:
    """How long a request's load has waited: what its lookup span tells (`kvscope.deferred.*`)."""

    lookups: int  # vLLM's lookups answered "not yet" (one per scheduler step that reached the request)
    first_ns: int  # when the first of them started (the caller's clock)
    load_tokens: int = 0  # the tokens its load would bring, as of the latest of them


class LoadAdmission:
    """The requests whose loads vLLM admitted and has not yet run, and the loads deferred behind them."""

    def __init__(self, layouts: list[GroupLayout], lookahead_tokens: int = 0):
        self.layouts = layouts
        self.lookahead_tokens = lookahead_tokens
        # vLLM's per-request cap of each sliding-window group (`request_blocks_bound`); None until the
        # caller has read them from vLLM (set before the first load is admitted)
        self.window_caps: dict[int, int] | None = None
        self._waiting: dict[str, int] = {}  # request id -> its blocks bound (`request_blocks_bound`)
        self._waiting_blocks = 0  # their sum
        # The deferred requests, in the order their loads were first deferred (public: the scheduler
        # reads a request's deferral at its lookup, once the dict is known to be non-empty)
        self.deferred: dict[str, Deferral] = {}
        self.deferrals = 0  # loads deferred so far, each counted once however many steps it waits

    @property
    def waiting_loads(self) -> int:
        return len(self._waiting)

    @property
    def waiting_requests(self) -> Iterable[str]:
        """The requests whose loads vLLM admitted and has not yet run."""
        return self._waiting.keys()

    def may_start(self, req_id: str, num_tokens: int, usable_blocks: int, now_ns: int = 0,
                  load_tokens: int = 0) -> bool:
        """Whether a load of ``req_id`` (of ``load_tokens``) may start now, given the device blocks a
        request can ever have (``usable_blocks``: the cache less vLLM's null block); ``now_ns``: when
        this lookup started, kept for the first one deferred. With no load waiting to run, vLLM's own
        checks decide: one such load always finds its blocks once the running requests are gone."""
        if not self._waiting:
            return True
        deferred = self.deferred
        first_deferred = next(iter(deferred), req_id)
        if first_deferred == req_id and self._bound(num_tokens) + self._waiting_blocks <= usable_blocks:
            return True
        deferral = deferred.get(req_id)
        if deferral is None:
            deferred[req_id] = Deferral(1, now_ns, load_tokens)
            self.deferrals += 1
        else:
            deferral.lookups += 1
            deferral.load_tokens = load_tokens
        return False

    def admitted(self, req_id: str, num_tokens: int, loads: bool) -> None:
        """vLLM admitted the request, with a load (``loads``) or without."""
        self.deferred.pop(req_id, None)
        if loads:
            self._forget_waiting(req_id)  # a preempted request loading again is counted once
            bound = self._bound(num_tokens)
            self._waiting[req_id] = bound
            self._waiting_blocks += bound

    def ran(self, req_ids: Iterable[str]) -> None:
        """vLLM scheduled these requests to run: their blocks are the running requests' now."""
        waiting = self._waiting
        if waiting:  # every step: most of these requests never waited for a load
            for req_id in req_ids:
                if req_id in waiting:
                    self._waiting_blocks -= waiting.pop(req_id)

    def ended(self, req_id: str) -> Deferral | None:
        """The request is gone (finished or aborted); its deferral if it ended still deferred."""
        self._forget_waiting(req_id)
        return self.deferred.pop(req_id, None)

    def _bound(self, num_tokens: int) -> int:
        return request_blocks_bound(self.layouts, num_tokens, self.lookahead_tokens, self.window_caps)

    def _forget_waiting(self, req_id: str) -> None:
        self._waiting_blocks -= self._waiting.pop(req_id, 0)
