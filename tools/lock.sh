#!/usr/bin/env bash
# Rebuilds requirements-lock.txt, the exact versions the README's install line takes: a brand-new
# virtual environment, torch and the ranges of requirements.txt (narrowed by any PIN given), then
# every installed version. Run it, then the tests and the quick start, before committing a new lock.
#
#   bash tools/lock.sh [PIN ...]           e.g. bash tools/lock.sh torch==2.13.0 transformers==5.24.0
#
# PYTHON picks the interpreter (default python3). The lock is for CPU Linux x86-64; torch is
# written without its local label (2.13.0, not 2.13.0+cpu), so a CUDA build of the same version
# satisfies it (docs/dependencies.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/fresh_venv.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fresh_venv "$work/venv"
python -m pip install --quiet --extra-index-url https://download.pytorch.org/whl/cpu \
    -r requirements.txt "$@"
{
    echo "# Exact versions for the README's install line: CPU Linux x86-64, $(python -c 'import sys; print("Python %d.%d" % sys.version_info[:2])')."
    echo "# Made by: bash tools/lock.sh $*"
    echo "# requirements.txt keeps the ranges; docs/dependencies.md says how to refresh this file."
    echo "# PyTorch's CPU wheel index: a CPU-only Linux box gets torch's CPU build (about 200 MB)"
    echo "# rather than PyPI's CUDA one with its 3 GB of CUDA wheels; a torch 2.13.0 already"
    echo "# installed (a CUDA build) satisfies torch==2.13.0 and is kept."
    echo "--extra-index-url https://download.pytorch.org/whl/cpu"
    python -m pip freeze --all --exclude-editable --exclude pip \
        | sed -E -e 's/^(torch==[^+]*)\+.*/\1/' \
                 -e 's/^(triton==.*)$/\1; sys_platform == "linux"/'
} > requirements-lock.txt
echo "requirements-lock.txt: $(grep -vc '^#' requirements-lock.txt) packages"
