"""Test and benchmark support that is not part of the product (not in the wheel).

* :mod:`ragbudget_testing.synthetic_receipts`: small valid receipt bodies and a tiny
  hand-written store with a deterministic fake retriever (receipt tests and benchmarks
  without models).
* :mod:`ragbudget_testing.llama_server`: llama.cpp's OpenAI-compatible server as a
  child process (the engine tests and ``python -m benchmarks.engines``).
* :mod:`ragbudget_testing.phoenix`: Arize Phoenix's trace server as a child process (the
  trace export test and ``python -m benchmarks.tracing_overhead``).
* :mod:`ragbudget_testing.netns`: network namespaces joined by veth pairs, as separate
  hosts on one machine (the fleet tests and ``python -m benchmarks.replica_auth``).

``tests/`` and ``benchmarks/`` import from here; no product room (``app``,
``retrieval``, ``generation``, ``latency_model``, ``receipts``, ``foundation``,
``migrations``) may (``tests/import_graph.py``), and pyproject.toml's package list
leaves this package out of the wheel.
"""
