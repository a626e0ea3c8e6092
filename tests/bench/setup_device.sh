# Sourced by the device scripts: $LOGS (every log of the run; run_on_device.sh packs it into
# $OUT/raw.tgz, since the device tool brings back at most 8 files), the repository root as
# cwd, structlog from the carried wheel (the GPU image has no structlog and no registry),
# an editable install.
OUT=${OUT:-/tmp/pinpool-out}
LOGS=${LOGS:-/tmp/pinpool-logs}
mkdir -p "$OUT" "$LOGS"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if ! python3 -c "import structlog" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "no structlog wheel in .whl/"; exit 1; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# An editable install registers the bench workloads (entry points) without copying code.
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 \
  || { echo "editable install failed"; cat "$LOGS/install.log"; }
