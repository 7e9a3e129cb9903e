"""The sim engine: a fake OpenAI-compatible engine for tests and benchmarks.

Run it as ``python -m llmgw.engines.sim --host H --port N --model NAME
[options]`` (or ``llmgw engine sim …``; the flags are
:func:`~llmgw.engines.sim.config.parse_args`'s). The key comes from
``LLAMA_API_KEY``, so the sim engine can stand in for llama.cpp; when it is
set every route but ``/health`` needs ``Authorization: Bearer <key>``.

``--refuse-key KEY=STATUS`` (repeatable) answers ``STATUS`` (400 to 599, in
OpenAI's error shape) to every request but ``/health`` bearing
``Authorization: Bearer KEY``, whether or not the engine has a key of its
own: a keyless sim so stands in for an outside provider where one key is at
its limit (429) or refused (401) while the others are served.

The modules, each one concern, each importing only those above it:

- :mod:`~llmgw.engines.sim.config`: :class:`SimConfig` and the command line.
- :mod:`~llmgw.engines.sim.request`: reading a request's body and fields.
- :mod:`~llmgw.engines.sim.answers`: what it answers (tokens, the prefix
  cache, embeddings, tool calls, reasoning, JSON, ``stop``, ``n``).
- :mod:`~llmgw.engines.sim.shapes`: those answers in OpenAI's shapes,
  whole or as server-sent events.
- :mod:`~llmgw.engines.sim.pacing`: time to first token, tokens per
  second, ticks, slots.
- :mod:`~llmgw.engines.sim.metrics`: counters and ``/metrics``.
- :mod:`~llmgw.engines.sim.app`: the ASGI app and its routes.
- :mod:`~llmgw.engines.sim.serve`: hypercorn, signals, ``main``.
- :mod:`~llmgw.engines.sim.adapter`: the engine adapter the agent uses.
"""
