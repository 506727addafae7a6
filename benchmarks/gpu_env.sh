# Sourced by the benchmarks/gpu_*.sh scripts: `gpu_env [PYTHON]` prints where a GPU run ran (date,
# commit, nvidia-smi, Python, torch and CUDA), for the script's env file.
gpu_env() {
  local py="${1:-python}"
  date -Is
  git rev-parse --short HEAD 2>/dev/null
  nvidia-smi 2>&1 | head -15
  "$py" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
}
