"""The ``kvhandoff`` command (``main``): its subcommands' parsers and what they share
(``args``), ``kvhandoff serve`` (``serve``) and the engine flags it turns into an
``EngineConfig`` (``engine_args``). What the other subcommands run lives in ``tools/``
(the demo, the harness, the benches, the soak, the probes) and is imported when used."""
