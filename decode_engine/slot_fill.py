"""A beam group's leader sent with its search's step 0, filled in here from step 0's
result: a part of ``decode_engine.beam_slots.SlotGroups``.

The front end (``decode_engine.beam``) sends a search's step 0 and its slots' leader
at once: the leader's last prompt token is a placeholder and its ``SlotSpec.after``
names step 0's group. It waits (``WAIT_KEY``) until step 0 has decided; then, before
the next schedule, :func:`fill_leader` writes step 0's first pick into the leader's
prompt (and its block hashes from there on), its beams' scores and the other slots'
tokens into its parameters, and the group's slots are made from it as for a leader
sent filled. The slots start in the engine step after step 0's, with no round trip
through the front end (docs/performance.md, "Stage 2 at concurrency").

A leader whose step 0 ended without a result (refused, failed, aborted) or left no live
beam ends with its group's error; the front end, which reads step 0's output first,
cancels it then anyway. Step 0 may end before its leader arrives: a one-slot group's
state outlives its request by :data:`KEEP_S` here, unless its leader took its result
already (:class:`Step0s`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from connector.params import SLOT_KEY
from decode_engine.slot_spec import GroupResult, SlotSpec

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from decode_engine.beam_group import Group

#: How long a step 0's state is kept after its request ended, for a leader still on its
#: way (sent together; the engine may read step 0's output before the leader arrives).
#: As long as a group waits for its slots.
KEEP_S = 30.0


class Step0s:
    """Step 0s (one-slot groups) that ended, for the leaders sent with them: kept
    :data:`KEEP_S` unless their leader took their result before they ended (a step 0
    kept for its slots to fork from ends after them)."""

    def __init__(self) -> None:
        self._ended: dict[str, tuple[float, Group]] = {}
        self._taken: set[str] = set()  # claimed while their request ran

    def ended(self, name: str, group: Group) -> None:
        """A one-slot group's last request left the scheduler."""
        if name in self._taken:
            self._taken.discard(name)
            return
        now = time.monotonic()
        self._ended[name] = (now, group)
        for old in [n for n, (at, _) in self._ended.items() if now - at > KEEP_S]:
            del self._ended[old]

    def __len__(self) -> int:
        return len(self._ended)

    def find(self, name: str, groups: dict[str, Group]) -> tuple[Group | None, bool]:
        """Step 0's group ``name`` and whether it ended (None: not seen yet)."""
        group = groups.get(name)
        if group is not None:
            return group, False
        ended = self._ended.get(name)
        return (ended[1], True) if ended is not None else (None, False)

    def claim(self, name: str) -> None:
        """A leader took step 0 ``name``'s result."""
        if self._ended.pop(name, None) is None:
            self._taken.add(name)


def why_not_ready(step0: Group, ended: bool) -> str | None:
    """Why a leader waiting on ``step0`` ends now (None: it goes on waiting, or step 0
    decided)."""
    if step0.result is not None and not step0.error:
        return None
    if step0.error:
        return f"its step 0 failed: {step0.error}"
    if ended:
        return "its step 0 ended without a result"
    return None


def fill_leader(leader: Request, spec: SlotSpec, step0: GroupResult,
                hash_block_size: int) -> SlotSpec | None:
    """Write step 0's picks into ``leader`` (module docstring); its filled parameters,
    or None when step 0 left no live beam. The slots start as the front end would send
    them: slot ``i`` with live beam ``min(i, live - 1)`` (the rest wait to be forked
    into)."""
    live = step0.live
    if not live:
        return None
    starts = [live[min(i, len(live) - 1)] for i in range(spec.members)]
    first = int(starts[0][1][-1])
    prompt = leader.prompt_token_ids
    assert prompt is not None
    prompt[-1] = first
    leader._all_token_ids[len(prompt) - 1] = first
    if leader.block_hashes:
        # Hashes from the block holding its own token on were made with the placeholder.
        leader.block_hashes = leader.block_hashes[:(len(prompt) - 1) // hash_block_size]
        leader.update_block_hashes()
    filled = spec.filled(len(live), starts[0][2],
                         tuple((int(t[-1]), float(c)) for _, t, c in starts[1:]))
    params = leader.sampling_params
    assert params is not None and params.extra_args is not None
    params.extra_args = {**params.extra_args, SLOT_KEY: filled.to_wire()}
    return filled
