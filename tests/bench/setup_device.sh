# Sourced by the device scripts: $OUT, the repository root as cwd, structlog from the
# carried wheel (the GPU image has no structlog and no registry), an editable install.
OUT=${OUT:-/tmp/pinpool-out}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if ! python3 -c "import structlog" 2>/dev/null; then
  # The GPU image has no structlog and no registry: install the carried wheel (.whl/).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "no structlog wheel in .whl/"; exit 1; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# An editable install registers the bench workloads (entry points) without copying code.
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "editable install failed"; cat "$OUT/install.log"; }
