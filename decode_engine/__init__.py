"""D, the decode/beam engine: the import of a parent's KV and beam search inside the
engine. The engine (``engine``: ``DecodeEngine``, ``run_beam_stage``) and the front side
of a search (``beam``: ``AsyncLLM.generate`` with its slots' parameters); the engine side:
the groups of slots in the scheduler (``beam_slots``, ``beam_group``), the logits
processor that picks each step's beams (``beam_processor``, its arithmetic in
``beam_search``; the catalogs beams may be kept in are ``engine.catalog``), and D's
scheduler vLLM loads by class path (``scheduler``). P's colocated path runs the same beam
search.

Nothing is imported here: the engine-core and worker processes load only the parts they
run.
"""
