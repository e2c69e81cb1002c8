# Sourced by .ci/run, tools/lock.sh and tools/newest.sh: `fresh_venv DIR` makes a brand-new
# virtual environment in DIR and activates it, with nothing of the machine's own packages
# visible (no system site-packages, no user site, no PYTHONPATH). PYTHON picks the interpreter.
fresh_venv() {
    "${PYTHON:-python3}" -m venv "$1"
    # shellcheck disable=SC1091
    source "$1/bin/activate"
    unset PYTHONPATH PYTHONHOME PYTHONUSERBASE PIP_USER
    export PYTHONNOUSERSITE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    hash -r
    python - <<'PY'
import sys, site
assert sys.prefix != sys.base_prefix, "not in a virtual environment"
assert not any("site-packages" in p and not p.startswith(sys.prefix) for p in sys.path), sys.path
print(f"fresh environment: {sys.prefix}, Python {sys.version.split()[0]}")
PY
}
