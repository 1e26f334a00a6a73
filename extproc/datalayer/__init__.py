"""kvgate's data layer: what the scheduler knows about its endpoints, kept fresh.

``metrics`` parses vLLM's ``/metrics``; ``nvml`` reads GPUs (in-process or through
``kvgate agent``, served by ``agent``); ``endpoints`` holds every endpoint's state in a store
the request path reads without waiting; ``scraper`` refreshes it every ~100 ms; and
``discovery`` decides which endpoints exist (static lists or DNS).
"""
