"""The simulated vLLM engine: an OpenAI-compatible server with vLLM's ``/metrics``.

A product component (``kvgate demo`` runs on it; tests and benchmarks use it too).
``model`` is vLLM V1's step loop and KV cache in virtual or real time; ``server`` is its
HTTP layer and the subprocess handle. Run one with ``python -m extproc.engine --port 8101``.
"""
