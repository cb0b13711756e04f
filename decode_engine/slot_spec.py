"""What a beam slot carries through vLLM, typed: the only code that writes a slot's
parameters into a request (``SamplingParams.extra_args[SLOT_KEY]``, a plain dict that
crosses from the front end to the engine core and its worker) and the only code that
reads them back (:meth:`SlotSpec.read`, which checks them).

The front side (``decode_engine.beam``) writes a group's slot 0, listing the other
slots to make (``clones``: each one's last prompt token and score); the scheduler side
(``decode_engine.beam_slots``) makes them (:meth:`SlotSpec.for_slot`); the logits
processor (``decode_engine.beam_processor``) reads every slot's in the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from connector.params import SLOT_KEY

#: A slot's parameters, every one required on the wire.
REQUIRED = ("group", "slot", "members", "width", "live", "steps", "cum", "eos",
            "ignore_eos", "catalog")

#: A clone's own last prompt tokens: one token (a search's first slots: step 0's pick),
#: a list of ``tail`` tokens (a search resumed after a move: each beam's tokens so far),
#: or None (the leader's prompt as it is: a slot waiting to be forked into).
CloneTail = int | tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class SlotSpec:
    """One slot: its group, its index, the number of slots in the group, the beam width,
    how many slots start with a live beam (the first ``live``; the others wait to be
    forked into), the beam steps the slots run, the cumulative logprob of the beam it
    starts with, the EOS rule of the search, the catalog the beams stay in (None:
    unconstrained), whether the beams start one token into an item (their last prompt
    token: the search's step 0 picked it), whether the search goes on after this group
    (step 0's: its live beams are returned whole items or not), and, on slot 0 as the
    front end sends it, the other slots to make: (its own last prompt tokens, score)
    each. ``tail``: how many last prompt tokens are the slot's beam's own (1: the first
    token step 0 picked; more in a search resumed on another engine after a move, whose
    beams arrive with the tokens they have so far); the prompt before them is the
    search's shared prefix."""

    group: str
    slot: int
    members: int
    width: int
    live: int
    steps: int
    cum: float
    eos: int | None
    ignore_eos: bool
    catalog: str | None = None
    in_item: bool = False
    goes_on: bool = False
    clones: tuple[tuple[CloneTail, float], ...] = ()
    tail: int = 1
    #: Stop the search to move it when this many beam steps ran (step 0 included, and a
    #: resumed search's steps before its move; 0: never): the harness's move at step k
    #: (``decode_engine.search_stops``). The slots' ``tail`` is the steps run before
    #: this group.
    stop_at: int = 0
    #: Sent with its search's step 0, before step 0's picks are known: the name of step
    #: 0's group. The scheduler fills in the leader's last prompt token, ``live``,
    #: ``cum`` and ``clones`` from step 0's result (``decode_engine.slot_fill``); ""
    #: once filled, or for a leader sent with them.
    after: str = ""

    def to_wire(self) -> dict[str, Any]:
        """The dict that travels under ``extra_args[SLOT_KEY]``."""
        wire: dict[str, Any] = {
            "group": self.group, "slot": self.slot, "members": self.members,
            "width": self.width, "live": self.live, "steps": self.steps,
            "cum": float(self.cum), "eos": self.eos, "ignore_eos": bool(self.ignore_eos),
            "catalog": self.catalog}
        if self.in_item:
            wire["in_item"] = True
        if self.goes_on:
            wire["goes_on"] = True
        if self.clones:
            wire["clones"] = [[list(t) if isinstance(t, tuple) else t, float(cum)]
                              for t, cum in self.clones]
        if self.tail != 1:
            wire["tail"] = self.tail
        if self.stop_at:
            wire["stop_at"] = self.stop_at
        if self.after:
            wire["after"] = self.after
        return wire

    def filled(self, live: int, cum: float, clones: tuple[tuple[CloneTail, float], ...]
               ) -> SlotSpec:
        """A leader sent ``after`` its step 0, once step 0's picks are known."""
        return replace(self, live=live, cum=float(cum), clones=clones, after="")

    def for_slot(self, slot: int, cum: float) -> SlotSpec:
        """Slot ``slot`` of this one's group, starting with a beam of score ``cum``."""
        return replace(self, slot=slot, cum=float(cum), clones=())

    @classmethod
    def read(cls, extra_args: dict[str, Any] | None) -> SlotSpec | None:
        """The slot a request's ``extra_args`` carry (None: not a beam slot). Raises
        ``ValueError`` naming what is wrong: a field missing, a slot outside its group,
        not ``live <= members <= width``."""
        wire = (extra_args or {}).get(SLOT_KEY)
        if wire is None:
            return None
        missing = [name for name in REQUIRED if name not in wire]
        if missing:
            raise ValueError(f"{SLOT_KEY}: missing {missing}")
        spec = cls(group=str(wire["group"]), slot=int(wire["slot"]),
                   members=int(wire["members"]), width=int(wire["width"]),
                   live=int(wire["live"]), steps=int(wire["steps"]), cum=float(wire["cum"]),
                   eos=None if wire["eos"] is None else int(wire["eos"]),
                   ignore_eos=bool(wire["ignore_eos"]), catalog=wire["catalog"],
                   in_item=bool(wire.get("in_item")), goes_on=bool(wire.get("goes_on")),
                   clones=tuple((_tail_of(t), float(c)) for t, c in wire.get("clones") or ()),
                   tail=int(wire.get("tail", 1)), stop_at=int(wire.get("stop_at", 0)),
                   after=str(wire.get("after") or ""))
        if not 0 <= spec.slot < spec.members:
            raise ValueError(f"{SLOT_KEY}: slot {spec.slot} outside the group's "
                             f"{spec.members}")
        if not 0 <= spec.live <= spec.members <= spec.width:
            raise ValueError(f"{SLOT_KEY}: live {spec.live}, members {spec.members}, "
                             f"width {spec.width} (live <= members <= width)")
        if spec.after and (spec.slot != 0 or spec.clones or spec.tail != 1
                           or spec.members < 2):
            raise ValueError(f"{SLOT_KEY}: a leader sent before its step 0's picks "
                             "(after) is slot 0 of a group of two or more, with tail 1 "
                             "and no clones")
        if spec.tail < 1 or any(isinstance(t, tuple) and len(t) != spec.tail
                                for t, _ in spec.clones):
            raise ValueError(f"{SLOT_KEY}: tail {spec.tail}, and every clone's tokens "
                             "that many")
        return spec


def _tail_of(wire: Any) -> CloneTail:
    if wire is None:
        return None
    if isinstance(wire, (list, tuple)):
        return tuple(int(t) for t in wire)
    return int(wire)


def slot_spec(*, group: str, slot: int, members: int, width: int, live: int, steps: int,
              cum_logprob: float, eos_token_id: int | None, ignore_eos: bool,
              catalog: str | None = None, in_item: bool = False, goes_on: bool = False,
              clones: list[tuple[CloneTail, float]] | None = None,
              tail: int = 1, stop_at: int = 0, after: str = "") -> dict[str, Any]:
    """A slot's parameters as they travel (:class:`SlotSpec`, its fields)."""
    return SlotSpec(group=group, slot=slot, members=members, width=width, live=live,
                    steps=steps, cum=float(cum_logprob), eos=eos_token_id,
                    ignore_eos=ignore_eos, catalog=catalog, in_item=in_item,
                    goes_on=goes_on, clones=tuple(clones or ()), tail=tail,
                    stop_at=stop_at, after=after).to_wire()


#: A beam a group returns: the slot it started in, the tokens the slots generated for
#: it (after the slot's first token, which the caller knows), its cumulative logprob.
WireBeam = tuple[int, list[int], float]


@dataclass(frozen=True, slots=True)
class GroupResult:
    """What a group returns on its slot 0's final output (``kv_transfer_params[KEY]
    [SLOT_KEY]``): the completed beams, then the live ones, in vLLM's order; how many
    live beams were dropped for not being whole items (a catalog's); each step's figures
    (``steps``: the processor's milliseconds, blocks copied, tokens the slots computed at
    their first step), added by the scheduler. The processor writes it, the scheduler
    adds the steps, the front side reads it."""

    completed: list[WireBeam]
    live: list[WireBeam]
    dropped: int = 0
    steps: dict[str, Any] | None = None
    #: The beam steps the group ran before it was stopped to move (0: it ran to its
    #: end); its live beams are then all returned, whole items or not.
    stopped: int = 0

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "completed": [[int(o), list(t), float(c)] for o, t, c in self.completed],
            "live": [[int(o), list(t), float(c)] for o, t, c in self.live]}
        if self.dropped:
            wire["dropped"] = int(self.dropped)
        if self.steps is not None:
            wire["steps"] = self.steps
        if self.stopped:
            wire["stopped"] = int(self.stopped)
        return wire

    def with_steps(self, steps: dict[str, Any]) -> GroupResult:
        return replace(self, steps=steps)

    @classmethod
    def read(cls, wire: dict[str, Any]) -> GroupResult:
        def beams(key: str) -> list[WireBeam]:
            return [(int(o), list(t), float(c)) for o, t, c in wire.get(key) or ()]

        return cls(completed=beams("completed"), live=beams("live"),
                   dropped=int(wire.get("dropped", 0)), steps=wire.get("steps"),
                   stopped=int(wire.get("stopped", 0)))
